"""Speculative decoding inside a step: per-position GDN state buffers for verification rows, the
commit of the accepted position, MTP drafting for the next step (all on the device, before the
step's single host sync), n-gram drafts on the host, and the per-sequence choice of source."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from qv.model.batch import AttentionMeta, GDNMeta, StepBatch
from qv.model.cache import INT16_MAX, HybridCache
from qv.model_config import ModelConfig
from qv.spec.mtp import MTPHead
from qv.spec.ngram import WINDOW as NGRAM_WINDOW
from qv.spec.ngram import propose_ngram

PROBE_SAMPLES = 4  # acceptance samples per source before `auto` trusts its running means
REPROBE_EVERY = 16  # then the other source is tried again every this many drafts
# Backoff: after FAILURES_TO_PAUSE drafts in a row with nothing accepted a sequence stops drafting for a pause
# that doubles from MIN_PAUSE to MAX_PAUSE decode steps; after a pause one failed probe pauses it again and one
# accepted token ends the backoff. A sequence whose drafts never pay thus drafts in at most 1 of MAX_PAUSE + 1
# steps once backed off (FAILURES_TO_PAUSE + log2(MAX_PAUSE / MIN_PAUSE) probes before that).
FAILURES_TO_PAUSE = 4
MIN_PAUSE, MAX_PAUSE = 4, 64


@dataclass
class Backoff:
    failures: int = 0  # drafts in a row that accepted nothing
    pause: int = 0  # decode steps left without drafts
    next_pause: int = MIN_PAUSE

    def drafted(self, accepted: int) -> None:
        if accepted:
            self.failures, self.next_pause = 0, MIN_PAUSE
            return
        self.failures += 1
        if self.failures >= FAILURES_TO_PAUSE:
            self.pause, self.next_pause = self.next_pause, min(2 * self.next_pause, MAX_PAUSE)
            self.failures = FAILURES_TO_PAUSE - 1  # the probe after the pause decides alone

    def paused(self) -> bool:
        """Whether this decode step skips drafting (counts the step down)."""
        if self.pause:
            self.pause -= 1
            return True
        return False


@dataclass
class SpecStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass
class SourceScore:
    """Running acceptance (tokens per draft) of one draft source for one sequence."""

    samples: int = 0
    mean: float = 0.0

    def add(self, accepted: int) -> None:
        self.samples += 1
        self.mean += (accepted - self.mean) / min(self.samples, 32)


@dataclass
class SequenceSpec:
    """What speculation keeps of one sequence: its backoff (None until it first may draft) and each draft
    source's running acceptance (auto mode)."""

    backoff: Backoff | None = None
    scores: dict[str, SourceScore] = field(default_factory=dict)


class Speculator:
    def __init__(self, mode: str, k: int, head: MTPHead | None, cfg: ModelConfig, cache: HybridCache,
                 max_seqs: int, device: torch.device, policy: str = "backoff"):
        self.mode, self.k, self.head, self.cache = mode, k, head, cache
        # "backoff" (serving), "always" (drafts every step, never backs off), "off" (no drafts and no MTP work
        # at all: the plain step a benchmark compares with)
        self.policy = policy
        self.max_seqs = max_seqs
        hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.inter_ssm = {i: torch.zeros(max_seqs, k + 1, hv, dk, dv, device=device) for i in cache.gdn}
        self.inter_conv = {i: torch.zeros((max_seqs, k + 1) + tuple(st.conv.shape[1:]), dtype=st.conv.dtype,
                                          device=device) for i, st in cache.gdn.items()}
        self.stats = SpecStats(accepted_per_pos=[0] * k)
        self._seqs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Sequence -> SequenceSpec, freed with it

    def of(self, seq) -> SequenceSpec:
        """The speculation state of `seq` (made on first use)."""
        state = self._seqs.get(seq)
        if state is None:
            state = self._seqs[seq] = SequenceSpec()
        return state

    @classmethod
    def for_engine(cls, cfg, head: MTPHead | None, model_cfg: ModelConfig, cache: HybridCache,
                   device: torch.device) -> "Speculator":
        """The engine's speculator from its levers (every tensor-parallel rank builds its own alike;
        model_cfg is the rank's view: the per-position states hold its GDN heads)."""
        return cls(cfg.spec, cfg.spec_k, head, model_cfg, cache, min(cfg.spec_max_seqs, cfg.max_num_seqs), device,
                   cfg.spec_policy)

    @property
    def uses_mtp(self) -> bool:
        return self.head is not None and self.mode in ("mtp", "auto")

    # -- host side: which source drafts next, and n-gram drafts ------------------------------
    def next_drafts(self, seq, mtp_drafts: list[int] | None) -> tuple[list[int], str | None]:
        """Drafts for the sequence's next step: exactly k tokens, or none (backed off, or no n-gram match).
        Either way seq.drafts.spare gets k tokens a decode-only step may verify it with."""
        seq.drafts.spare = mtp_drafts or [seq.token_at(seq.num_tokens - 1)] * self.k
        state = self.of(seq)
        backoff = state.backoff = state.backoff or Backoff()
        if self.policy == "off" or (backoff.paused() and self.policy == "backoff"):
            return [], None
        drafts, source = self.choose(seq, mtp_drafts)
        if not drafts and self.policy == "always":  # every step verifies, spare drafts where the source has none
            return list(seq.drafts.spare), "filler"
        return drafts, source

    def choose(self, seq, mtp_drafts: list[int] | None) -> tuple[list[int], str | None]:
        """The mode's drafts for `seq` regardless of backoff: (k tokens, "ngram" | "mtp") or ([], None) where
        no source has any. `auto` probes both sources, then keeps the one of higher running acceptance and
        retries the other every REPROBE_EVERY drafts. mtp_drafts: the head's k drafts, None without them."""
        tail = seq.token_array(max(0, seq.num_tokens - NGRAM_WINDOW))  # not the whole context
        ngram = propose_ngram(tail, self.k) if self.mode in ("ngram", "auto") else None
        if self.mode == "ngram" or mtp_drafts is None:
            return (ngram, "ngram") if ngram else ([], None)
        if self.mode == "mtp" or ngram is None:
            return mtp_drafts, "mtp"
        scores = self.of(seq).scores
        ng, mt = scores.setdefault("ngram", SourceScore()), scores.setdefault("mtp", SourceScore())
        if ng.samples < PROBE_SAMPLES or mt.samples < PROBE_SAMPLES:  # probe both, alternating
            pick = "ngram" if ng.samples <= mt.samples else "mtp"
        else:
            best, other = ("ngram", "mtp") if ng.mean > mt.mean else ("mtp", "ngram")
            pick = other if (ng.samples + mt.samples) % REPROBE_EVERY == 0 else best
        return (ngram, "ngram") if pick == "ngram" else (mtp_drafts, "mtp")

    def record(self, seq, source: str, accepted: int) -> None:
        """A verified draft's outcome. Spare drafts (source "filler") verified only to keep the step uniform
        count in neither the metrics nor the backoff: nobody asked for them."""
        if source == "filler":
            return
        if self.policy == "backoff":
            self.of(seq).backoff.drafted(accepted)
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += self.k
        s.num_accepted_tokens += accepted
        for j in range(accepted):
            s.accepted_per_pos[j] += 1
        self.of(seq).scores.setdefault(source, SourceScore()).add(accepted)

    # -- device side: verification states and their commit -----------------------------------
    def gdn_meta(self, slots, has_init, num_spec_seqs: int, num_spec_tokens: int, cu_rest) -> GDNMeta:
        s = num_spec_seqs
        return GDNMeta(slots, has_init, s, num_spec_tokens, {i: b[:s] for i, b in self.inter_ssm.items()},
                       {i: b[:s] for i, b in self.inter_conv.items()}, cu_rest)

    def commit(self, slots: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """Each verified sequence's GDN state becomes the state after its last accepted position."""
        s = slots.shape[0]
        pick = torch.arange(s, device=slots.device)
        for i, st in self.cache.gdn.items():
            value = self.inter_ssm[i][pick, num_accepted]  # [S, Hv, dk, dv]
            if st.ssm.dtype == torch.int16:
                scale = value.abs().amax(dim=2).clamp_min(1e-30) / INT16_MAX
                st.ssm_scale[slots] = scale
                value = torch.round(value / scale[:, :, None, :]).clamp(-INT16_MAX, INT16_MAX)
            st.ssm[slots] = value.to(st.ssm.dtype)
            st.conv[slots] = self.inter_conv[i][pick, num_accepted]

    # -- device side: MTP drafts for the next step --------------------------------------------
    def mtp_work(self, seqs) -> str | None:
        """What the MTP head does after a step over `seqs`: "draft" (its KV catches up with the step's rows,
        then k drafts a sequence), "catch_up" (the KV only: every sequence is backed off, and drafting
        later needs the head's KV at every position; also where more sequences run than can verify next
        step) or None (no MTP head, or policy "off")."""
        if not self.uses_mtp or self.policy == "off":
            return None
        if len(seqs) > self.max_seqs:  # too many to verify next step (scheduler._even_drafts): no drafts needed
            return "catch_up"
        if self.policy == "always" or any(self.of(s).backoff is None or self.of(s).backoff.pause == 0 for s in seqs):
            return "draft"
        return "catch_up"

    def mtp_inputs(self, next_ids: torch.Tensor, rows_with_logits: torch.Tensor, num_spec: int,
                   tokens: torch.Tensor | None, n_acc: torch.Tensor | None, sampled: torch.Tensor | None,
                   kind: str) -> torch.Tensor | None:
        """Writes the step's emitted tokens into `next_ids` (a verified row's own emitted token, a sampler's
        sampled id) and returns the last valid row of each sequence that drafts ([D], verified sequences
        first), or None where nothing drafts (kind "catch_up", or no sequence got a token).
        rows_with_logits: the verified sequences' k+1 rows each, then each sampler's last row."""
        rows = []
        k1 = tokens.shape[1] if num_spec else 0
        if num_spec:  # verified rows see the emitted tokens; the last valid row is row n_accepted
            spec_rows = rows_with_logits[:num_spec * k1].view(num_spec, k1)
            next_ids[spec_rows.reshape(-1)] = tokens.reshape(-1)
            rows.append(spec_rows[:, 0] + n_acc)
        if sampled is not None:
            last = rows_with_logits[num_spec * k1:]
            next_ids[last] = sampled
            rows.append(last)
        return torch.cat(rows) if rows and kind == "draft" else None

    @staticmethod
    def drafting_seqs(num_spec: int, samplers) -> np.ndarray:
        """The batch indices of the sequences the MTP walk drafts for, in mtp_inputs' row order: the
        verified ones, then the samplers."""
        return np.asarray(list(range(num_spec)) + list(samplers), dtype=np.int64)

    def mtp_eager(self, positions: torch.Tensor, hidden: torch.Tensor, batch: StepBatch, next_ids: torch.Tensor,
                  draft_rows: torch.Tensor | None, draft_seqs: np.ndarray, max_seq_len: int,
                  rope: torch.Tensor | None = None, rope_delta: torch.Tensor | None = None) -> torch.Tensor | None:
        """The head's passes after a step, eagerly: the catch-up over every row, then (draft_rows given) the
        walk from each drafting sequence's last valid row. draft_seqs: those sequences' indices in the
        batch. [D, k] drafts, or None."""
        out = self.catch_up(positions, hidden, batch, next_ids, rope=rope)
        if draft_rows is None:
            return None
        tables = batch.attn.block_tables[torch.from_numpy(draft_seqs).to(positions.device)]
        return self.walk(out, positions, draft_rows, tables, None, max_seq_len, rope_delta=rope_delta)

    def catch_up(self, positions: torch.Tensor, hidden: torch.Tensor, batch: StepBatch, next_ids: torch.Tensor,
                 rope: torch.Tensor | None = None) -> torch.Tensor:
        """The head over every row of the step: its KV catches up with the target's. `positions` are token
        indices (KV slots); with images the rotary positions differ and `rope` holds the step's ([T] or
        mRoPE [3, T]). Returns the head's output states [T, H]."""
        return self.head.forward(next_ids, hidden, positions if rope is None else rope, batch, self.cache)

    def walk(self, out: torch.Tensor, positions: torch.Tensor, draft_rows: torch.Tensor, tables: torch.Tensor,
             valid: torch.Tensor | None, max_seq_len: int, rope_delta: torch.Tensor | None = None) -> torch.Tensor:
        """k drafts for each drafting sequence from the catch-up's output states `out`: the first from its
        last valid row (`draft_rows` [D]), then k-1 single-row head steps, each feeding its draft and state
        back in. tables [D, MB]: the sequences' block tables; valid [D] bool (None: all) leaves padding rows
        inert (no KV writes); rope_delta [D]: what each draft position adds to get its rotary position
        (images). Launch shapes depend on D, k and max_seq_len only, so a CUDA graph can hold it. [D, k]."""
        head, bs = self.head, self.cache.block_size
        state = out[draft_rows]
        drafts = [head.draft_ids(state)]
        pos = positions[draft_rows]
        d, dev = draft_rows.shape[0], out.device
        cu = torch.arange(d + 1, dtype=torch.int32, device=dev)
        rows = torch.arange(d, device=dev)
        no_state = torch.zeros(d, dtype=torch.bool, device=dev)
        for step in range(1, self.k):
            p = pos + step
            slot_mapping = tables[rows, p // bs].long() * bs + p % bs
            if valid is not None:
                slot_mapping = torch.where(valid, slot_mapping, -1)
            ar = StepBatch(cu, 1, AttentionMeta(slot_mapping, tables, (p + 1).to(torch.int32), max_seq_len + step),
                           GDNMeta(torch.zeros(d, dtype=torch.int64, device=dev), no_state), logits_indices=rows)
            state = head.forward(drafts[-1], state, p if rope_delta is None else p + rope_delta, ar, self.cache)
            drafts.append(head.draft_ids(state))
        return torch.stack(drafts, dim=1)
