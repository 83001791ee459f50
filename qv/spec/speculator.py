"""Speculative decoding inside a step: per-position GDN state buffers for verification rows, the
commit of the accepted position, MTP drafting for the next step (all on the device, before the
step's single host sync), n-gram drafts on the host, and the per-sequence choice of source."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from qv.config import ModelConfig
from qv.model.batch import AttentionMeta, GDNMeta, StepBatch
from qv.model.cache import INT16_MAX, HybridCache
from qv.spec.mtp import MTPHead
from qv.spec.ngram import WINDOW as NGRAM_WINDOW
from qv.spec.ngram import propose_ngram

PROBE_SAMPLES = 4  # acceptance samples per source before `auto` trusts its running means
REPROBE_EVERY = 16  # then the other source is tried again every this many drafts


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


class Speculator:
    def __init__(self, mode: str, k: int, head: MTPHead | None, cfg: ModelConfig, cache: HybridCache,
                 max_seqs: int, device: torch.device):
        self.mode, self.k, self.head, self.cache = mode, k, head, cache
        self.max_seqs = max_seqs
        hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.inter_ssm = {i: torch.zeros(max_seqs, k + 1, hv, dk, dv, device=device) for i in cache.gdn}
        self.inter_conv = {i: torch.zeros((max_seqs, k + 1) + tuple(st.conv.shape[1:]), dtype=st.conv.dtype,
                                          device=device) for i, st in cache.gdn.items()}
        self.stats = SpecStats(accepted_per_pos=[0] * k)

    @property
    def uses_mtp(self) -> bool:
        return self.head is not None and self.mode in ("mtp", "auto")

    # -- host side: which source drafts next, and n-gram drafts ------------------------------
    def next_drafts(self, seq, mtp_drafts: list[int] | None) -> tuple[list[int], str | None]:
        """Drafts for the sequence's next step: exactly k tokens, or none."""
        tail = seq.token_slice(max(0, seq.num_tokens - NGRAM_WINDOW), seq.num_tokens)  # not the whole context
        ngram = propose_ngram(tail, self.k) if self.mode in ("ngram", "auto") else None
        if self.mode == "ngram" or mtp_drafts is None:
            return (ngram, "ngram") if ngram else ([], None)
        if self.mode == "mtp" or ngram is None:
            return mtp_drafts, "mtp"
        scores = seq.spec_scores
        ng, mt = scores.setdefault("ngram", SourceScore()), scores.setdefault("mtp", SourceScore())
        if ng.samples < PROBE_SAMPLES or mt.samples < PROBE_SAMPLES:  # probe both, alternating
            pick = "ngram" if ng.samples <= mt.samples else "mtp"
        else:
            best, other = ("ngram", "mtp") if ng.mean > mt.mean else ("mtp", "ngram")
            pick = other if (ng.samples + mt.samples) % REPROBE_EVERY == 0 else best
        return (ngram, "ngram") if pick == "ngram" else (mtp_drafts, "mtp")

    def record(self, seq, source: str, accepted: int) -> None:
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += self.k
        s.num_accepted_tokens += accepted
        for j in range(accepted):
            s.accepted_per_pos[j] += 1
        seq.spec_scores.setdefault(source, SourceScore()).add(accepted)

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
    def draft_mtp(self, positions: torch.Tensor, hidden: torch.Tensor, batch: StepBatch, next_ids: torch.Tensor,
                  draft_rows: torch.Tensor | None, draft_seqs: np.ndarray, max_seq_len: int,
                  rope: torch.Tensor | None = None, rope_delta: torch.Tensor | None = None) -> torch.Tensor | None:
        """Run the head over every row of the step (its KV catches up with the target), then k-1 more
        single-row steps from `draft_rows` (the last valid row of each drafting sequence). Returns [D, k].
        `positions` are token indices (KV slots); with images the rotary positions differ: `rope` is the
        step's ([T] or mRoPE [3, T]) and `rope_delta` [D] what each draft position (past its prompt) adds."""
        head, bs = self.head, self.cache.block_size
        out = head.forward(next_ids, hidden, positions if rope is None else rope, batch, self.cache)
        if draft_rows is None:
            return None
        ids = next_ids
        state = out[draft_rows]
        drafts = [head.draft_ids(state)]
        pos = positions[draft_rows]
        d = len(draft_seqs)
        tables = batch.attn.block_tables[torch.from_numpy(draft_seqs).to(ids.device)]
        cu = torch.arange(d + 1, dtype=torch.int32, device=ids.device)
        rows = torch.arange(d, device=ids.device)
        no_state = torch.zeros(d, dtype=torch.bool, device=ids.device)
        for step in range(1, self.k):
            p = pos + step
            slot_mapping = tables[rows, p // bs].long() * bs + p % bs
            ar = StepBatch(cu, 1, AttentionMeta(slot_mapping, tables, (p + 1).to(torch.int32), max_seq_len + step),
                           GDNMeta(torch.zeros(d, dtype=torch.int64, device=ids.device), no_state),
                           logits_indices=rows)
            state = head.forward(drafts[-1], state, p if rope_delta is None else p + rope_delta, ar, self.cache)
            drafts.append(head.draft_ids(state))
        return torch.stack(drafts, dim=1)
