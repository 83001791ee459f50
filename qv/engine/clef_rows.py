"""Clef records inside the engine: prefill-only sequences whose rows run Clef's weights and whose
final-norm hidden rows feed the joint schema head, chunk by chunk.

A record is one Sequence (its token ids are the encoded record) with its own cache salt
"clef:<request id>", so the prefix cache never reads or registers its blocks and the block pool
keeps it out of the chat reserve (qv/engine/prefix_cache.py, kv_cache.py). ClefRows is the one
place that knows which sequences are records:

- admission: at most `slots` records are in the scheduler at once; the others wait here, in
  arrival order, and go in as records finish (`admit`, called at the start of every step);
- the batch: `delta_rows` gives the flat rows of the step's records, the only rows the low-rank
  deltas touch (chat rows of the same batch compute the served weights);
- the tap: `take_hidden` feeds each record's rows to its HeadState right after the forward and
  hashes the token ids that ran; a chunk at token 0 after earlier chunks means the record was
  preempted (recompute), so the head state and the hash start again (no span summed twice);
- images: the vision steps keep a record's MultimodalPrompt as a chat's (VisionSteps.add), so they
  encode them inside its prefill chunks and give its rows mRoPE positions, as for a chat;
- the end: `finish_ready` answers the records whose last chunk ran (they never sample), after
  checking that the tokens that ran are the record the endpoint encoded (length + checksum).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from qv.clef.answers import answers
from qv.clef.encode import EncodedRecord, TokenChecksum
from qv.clef.head import HeadState, JointHead, max_state_bytes
from qv.config import EngineConfig
from qv.engine.prefix_cache import CLEF_SALT_PREFIX
from qv.engine.sequence import Sequence
from qv.engine.step_feature import StepFeature
from qv.errors import InvalidRequestError

log = logging.getLogger("qv")


@dataclass
class ClefResult:
    """A finished record: per-option probabilities (encoded option order); `answers` formats them
    as systemone does (qv/clef/answers.py), off the engine thread."""

    record: EncodedRecord
    probabilities: list[list[float]]
    restarts: int  # times the record was preempted and recomputed from its first token

    @property
    def answers(self) -> dict:
        return answers(self.record, self.probabilities)


class _Job:
    def __init__(self, seq: Sequence, record: EncodedRecord):
        self.seq, self.record = seq, record
        self.expected = (record.num_tokens, record.checksum)  # what was encoded, hashed before anything ran
        self.state: HeadState | None = None  # allocated at admission, dropped at the end
        self.ran = TokenChecksum()  # the token ids that ran, chunk by chunk
        self.restarts = 0
        self.error: str | None = None
        self.result: ClefResult | None = None


class ClefRows(StepFeature):
    def __init__(self, head: JointHead, output_embedding, slots: int, cap: int, cap_name: str, has_deltas: bool):
        self.head, self.output_embedding = head, output_embedding
        self.slots, self.cap, self.cap_name = slots, cap, cap_name
        self.has_deltas = has_deltas
        self.rows_grouped = False  # served LoRA adapters group every delta row by bank slot (LoraRows.fill_inputs)
        self.jobs: dict[Sequence, _Job] = {}
        self.by_request: dict[str, _Job] = {}
        self.pending: deque[_Job] = deque()  # records waiting for a Clef slot
        self.active: list[_Job] = []  # records in the scheduler
        self.num_restarts = 0

    # -- requests ------------------------------------------------------------------------------
    def check(self, record: EncodedRecord, capacity_tokens: int) -> None:
        """Refuse a record the engine cannot run (InvalidRequestError, with the counts)."""
        n = record.num_tokens
        if n > self.cap:
            raise InvalidRequestError(f"Clef record has {n} tokens, over the Clef record cap of {self.cap} "
                                      f"({self.cap_name})")
        if n + 1 > capacity_tokens:
            raise InvalidRequestError(f"Clef record has {n} tokens but the KV cache holds {capacity_tokens} tokens "
                                      "for Clef rows; raise kv_cache_bytes or lower prefix_cache_chat_reserve")

    def add(self, seq: Sequence, record: EncodedRecord) -> None:
        job = _Job(seq, record)
        self.jobs[seq] = job
        self.by_request[seq.request_id] = job
        self.pending.append(job)

    def owns(self, seq: Sequence) -> bool:
        return seq in self.jobs

    @property
    def num_pending(self) -> int:
        return len(self.pending)

    # -- StepFeature: admission before the plan, answers after the forward. Records never hold the next step (async
    # scheduling): they sample nothing, their head reads its rows at the launch (stream-ordered), and a finished
    # record's answers are read after its last chunk's forward, before the next plan
    num_queued = num_pending

    def before_plan(self, scheduler) -> list[str]:
        return self.admit(scheduler)

    def after_forward(self, scheduled, scheduler) -> list[str]:
        return self.finish_ready(scheduled, scheduler)

    def finished_output(self, request_id: str) -> dict:
        return {"clef": self.pop_result(request_id)}

    # -- StepFeature, the runner's side: records never sample, their rows take the deltas (no graph replays
    # them then) and feed the joint head
    def samples(self, seq: Sequence) -> bool:
        return seq not in self.jobs

    def replayable(self, seqs: list[Sequence], deltas_captured: bool) -> bool:
        return deltas_captured or not (self.has_deltas and any(s in self.jobs for s in seqs))

    def fill_inputs(self, seqs: list[Sequence], cu: np.ndarray, host: dict) -> dict[str, int]:
        """The records' rows as bank slot 0's group (the step's capacity has that slot whenever there are
        deltas), written every step so that a graph replaying the grouped deltas finds the slot's extent."""
        if self.rows_grouped or not self.has_deltas:  # LoraRows writes the step's delta rows, these in slot 0
            return {}
        n = self.delta_rows(seqs, cu, host["delta_rows"])
        host["delta_slot_start"][:2] = (0, n)
        return {"delta_rows": n, "delta_slot_start": 2}

    def admit(self, scheduler) -> list[str]:
        """Move waiting records into the scheduler while fewer than `slots` are in it. Returns the
        request ids of records that failed on admission (their head state could not be made):
        finished with an error at once, without running a chunk."""
        self.active = [j for j in self.active if not j.seq.finished]  # (aborted waiting ones left in pop_result)
        failed = []
        while self.pending and len(self.active) < self.slots:
            job = self.pending.popleft()
            try:
                job.state = self.head.state(job.record, self.output_embedding)
            except Exception as exc:  # noqa: BLE001 - e.g. out of memory: fails this record only
                log.exception("Clef head state for request %s", job.seq.request_id)
                scheduler.finish(job.seq, "error", error=f"the Clef head state could not be created: "
                                                         f"{type(exc).__name__}: {exc}")
                failed.append(job.seq.request_id)
                continue
            self.active.append(job)
            scheduler.add(job.seq)
        return failed

    def pop_result(self, request_id: str) -> ClefResult | None:
        """The result of a finished record (None for chats and failed records); forgets the record."""
        job = self.by_request.get(request_id)
        if job is None or not job.seq.finished:
            return None
        del self.by_request[request_id]
        self.jobs.pop(job.seq, None)
        if job in self.pending:  # aborted while it waited: its record and images go now
            self.pending.remove(job)
        job.state = None
        return job.result

    # -- the step ------------------------------------------------------------------------------
    def delta_rows(self, seqs: list[Sequence], cu: np.ndarray, out: np.ndarray) -> int:
        """Write the flat rows of the step's records (batch order `seqs`, row offsets `cu`) into `out` (the
        step's `delta_rows` input field) and return how many (0: the step has none)."""
        parts = [np.arange(cu[i], cu[i + 1]) for i, s in enumerate(seqs) if s in self.jobs]
        if not parts:
            return 0
        rows = np.concatenate(parts)
        out[:rows.size] = rows
        return rows.size

    def take_hidden(self, seqs: list[Sequence], cu: np.ndarray, hidden: torch.Tensor, ids: np.ndarray) -> None:
        """Feed each record's final-norm hidden rows (and the token ids that ran) to its head."""
        for i, seq in enumerate(seqs):
            job = self.jobs.get(seq)
            if job is None or job.error or job.state is None:
                continue
            start, lo, hi = seq.num_computed_tokens, int(cu[i]), int(cu[i + 1])
            if start == 0 and job.ran.num_tokens:  # preempted and recomputed: start over
                job.state.reset()
                job.ran = TokenChecksum()
                job.restarts += 1
                self.num_restarts += 1
            try:
                job.ran.update(ids[lo:hi])
                job.state.add_chunk(hidden[lo:hi], start)
            except Exception as exc:  # noqa: BLE001 - fails this record only, never the engine
                log.exception("Clef head failed on request %s", seq.request_id)
                job.error = f"the Clef head failed: {type(exc).__name__}: {exc}"

    def finish_ready(self, scheduled: list[tuple[Sequence, int]], scheduler) -> list[str]:
        """Answer (or fail) the records whose last chunk ran this step; returns their request ids.
        Their blocks and slots go back at once."""
        done = []
        for seq, _ in scheduled:
            job = self.jobs.get(seq)
            if job is None or seq.finished or (job.error is None and seq.num_computed_tokens < seq.num_tokens):
                continue
            error = job.error or self._mismatch(job)
            if error is None:
                try:
                    job.result = ClefResult(job.record, job.state.probabilities(), job.restarts)
                except Exception as exc:  # noqa: BLE001
                    log.exception("Clef head failed on request %s", seq.request_id)
                    error = f"the Clef head failed: {type(exc).__name__}: {exc}"
            job.state = None
            if error is None:
                scheduler.finish(seq, "stop")
            else:
                scheduler.finish(seq, "error", error=error)
            done.append(seq.request_id)
        return done

    @staticmethod
    def _mismatch(job: _Job) -> str | None:
        ran = (job.ran.num_tokens, job.ran.hexdigest())
        if ran == job.expected:
            return None
        return (f"Clef record refused: the engine ran {ran[0]} tokens with checksum {ran[1]}, but the endpoint "
                f"encoded {job.expected[0]} tokens with checksum {job.expected[1]}")


def clef_sequence(seq_id: int, request_id: str, record: EncodedRecord, params, detok, arrival_order: int
                  ) -> Sequence:
    """The engine sequence of a record: its ids, one 'token' of room, its own cache salt, and its
    images' hashes for the prefix key (the vision steps keep its images: VisionSteps.add)."""
    mm_hashes = record.multimodal.mm_hashes if record.multimodal is not None else None
    return Sequence(seq_id, request_id, 0, list(record.input_ids), params, 1, 0, detok, arrival_order,
                    cache_salt=f"{CLEF_SALT_PREFIX}{request_id}", mm_hashes=mm_hashes)


def make_clef_rows(assets, model, slots: int, nmax: int, max_model_len: int) -> ClefRows | None:
    """ClefRows for loaded Clef assets (qv.clef.adapters.ClefAssets); None when Clef is not served."""
    if assets is None:
        return None
    cap, cap_name = (nmax, "QV_CLEF_NMAX") if nmax <= max_model_len else (max_model_len, "max_model_len")
    if cap < nmax:  # a warning only when the user raised QV_CLEF_NMAX past max_model_len, not for two defaults
        level = logging.INFO if nmax == EngineConfig.model_fields["clef_nmax"].default else logging.WARNING
        log.log(level, "Clef records are capped at max_model_len=%d tokens (QV_CLEF_NMAX is %d)", max_model_len, nmax)
    log.info("Clef: %s layout, %d slots, records up to %d tokens, deltas %.1f MiB (%d LoRA, %d deabl modules)",
             assets.layout, slots, cap, assets.delta_bytes / 2**20, assets.lora_modules, assets.deabl_modules)
    output = model.lm_head.weight if assets.output_embedding is None else assets.output_embedding  # whole under TP
    return ClefRows(assets.head, output, slots, cap, cap_name, assets.delta_bytes > 0)


def clef_reserve_bytes(assets, slots: int, nmax: int) -> int:
    """Device bytes the head states of `slots` records of `nmax` tokens can hold (memory plan)."""
    return 0 if assets is None else slots * max_state_bytes(assets.head.config, nmax)
