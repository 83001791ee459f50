"""Speculative decoding as a step feature (qv/engine/step_feature.py): after each sequence's result,
the verified drafts' outcome goes to the Speculator (backoff, acceptance counters) and the next step's
drafts come from it, where the sequence has room for them; its counters fill the engine's stats, with
a summary in the log every SPEC_LOG_EVERY steps. The drafting, verification and MTP head: qv/spec/."""

from __future__ import annotations

import logging

from qv.engine.step_feature import StepFeature
from qv.spec.speculator import Speculator

log = logging.getLogger("qv")
SPEC_LOG_EVERY = 500  # steps between speculation summaries in the log


class SpeculationSteps(StepFeature):
    def __init__(self, spec: Speculator, max_model_len: int):
        self.spec, self.max_model_len = spec, max_model_len
        self._steps = 0

    def before_plan(self, scheduler) -> list[str]:
        self._steps += 1
        st = self.spec.stats
        if self._steps % SPEC_LOG_EVERY == 0 and st.num_drafts:
            log.info("speculation (%s, k=%d): mean acceptance length %.2f over %d drafts", self.spec.mode,
                     self.spec.k, st.mean_acceptance_length, st.num_drafts)
        return []

    def after_result(self, seq, result) -> None:
        source = seq.drafts.source  # what the drafts this step ran were; verified or not, they are spent
        seq.drafts.clear()
        if result.num_accepted is not None:
            self.spec.record(seq, source, result.num_accepted)
        if seq.finished:
            return
        if self._room_for_drafts(seq):  # a structured output's drafts are checked by its grammar
            seq.drafts.tokens, seq.drafts.source = self.spec.next_drafts(seq, result.next_mtp_drafts)
        else:
            seq.drafts.spare = []

    def _room_for_drafts(self, seq) -> bool:
        """Room for k draft rows and the head's lookahead before max_model_len (tokens accepted past
        max_tokens are cut when appended, so the output limit needs no room)."""
        return seq.num_tokens + 2 * self.spec.k + 1 < self.max_model_len

    def report(self, stats) -> None:
        sp = self.spec.stats
        stats.spec_num_drafts, stats.spec_num_draft_tokens = sp.num_drafts, sp.num_draft_tokens
        stats.spec_num_accepted_tokens, stats.spec_num_accepted_tokens_per_pos = sp.num_accepted_tokens, list(
            sp.accepted_per_pos)
