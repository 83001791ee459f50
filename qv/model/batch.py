"""The explicit description of one forward step: which tokens belong to which sequence, where
each sequence's KV blocks and GDN state slot live, and which rows need logits.

The engine's runner fills these from preallocated buffers; `build_step_batch` builds one from
plain Python lists for tests and simple callers. All index tensors live on the model's device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qv.kernels.grouped_delta import DeltaGroups


@dataclass(frozen=True)
class AttentionMeta:
    slot_mapping: torch.Tensor  # [T] int64: cache slot (block * block_size + offset) of each new token; -1 skips
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32: keys of each sequence after this step
    max_seq_len: int


@dataclass(frozen=True)
class GDNMeta:
    state_slots: torch.Tensor  # [B] int64: GDN state slot of each sequence
    has_initial_state: torch.Tensor  # [B] bool: false starts the sequence from zero state
    # Speculative verification: the first `num_spec_seqs` sequences (their `num_spec_tokens` rows come first)
    # keep the state after every position, so the accepted one can be committed after sampling.
    num_spec_seqs: int = 0
    num_spec_tokens: int = 0
    intermediate_states: dict[int, torch.Tensor] | None = None  # layer -> [S, k+1, Hv, dk, dv]
    intermediate_conv: dict[int, torch.Tensor] | None = None  # layer -> [S, k+1, W-1, C]
    cu_seqlens_rest: torch.Tensor | None = None  # [B-S+1] int32: cu_seqlens of the other sequences, from 0


@dataclass(frozen=True)
class StepBatch:
    cu_seqlens_q: torch.Tensor  # [B+1] int32: token rows of each sequence in the flat batch
    max_query_len: int
    attn: AttentionMeta
    gdn: GDNMeta
    logits_indices: torch.Tensor  # [R] int64: token rows whose hidden state goes to the lm_head
    # rows computed with low-rank weight deltas: [R'] int64 rows of Clef's slot 0, or a DeltaGroups (rows grouped
    # by delta-bank slot: Clef's and served LoRA adapters', qv/model/delta_bank.py)
    delta_rows: torch.Tensor | DeltaGroups | None = None

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens_q.shape[0] - 1


def build_step_batch(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    state_slots: list[int],
    block_size: int,
    device: torch.device | str = "cpu",
    logits_rows: list[int] | None = None,
    delta_rows: list[int] | None = None,
) -> StepBatch:
    """A StepBatch from Python lists. Sequence b computes tokens seq_lens[b]-query_lens[b] .. seq_lens[b]-1.

    By default every sequence's last token gets logits; a sequence that starts at position 0 starts
    from zero GDN state.
    """
    cu = [0]
    slots: list[int] = []
    for q, n, table in zip(query_lens, seq_lens, block_tables):
        cu.append(cu[-1] + q)
        for pos in range(n - q, n):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    width = max([len(t) for t in block_tables] + [1])
    tables = [t + [0] * (width - len(t)) for t in block_tables]
    if logits_rows is None:
        logits_rows = [cu[i + 1] - 1 for i in range(len(query_lens)) if query_lens[i] > 0]
    as_t = lambda x, dt: torch.tensor(x, dtype=dt, device=device)  # noqa: E731
    return StepBatch(
        cu_seqlens_q=as_t(cu, torch.int32),
        max_query_len=max(query_lens, default=0),
        attn=AttentionMeta(
            slot_mapping=as_t(slots, torch.int64),
            block_tables=as_t(tables, torch.int32),
            seq_lens=as_t(seq_lens, torch.int32),
            max_seq_len=max(seq_lens, default=0),
        ),
        gdn=GDNMeta(
            state_slots=as_t(state_slots, torch.int64),
            has_initial_state=as_t([n - q > 0 for q, n in zip(query_lens, seq_lens)], torch.bool),
        ),
        logits_indices=as_t(logits_rows, torch.int64),
        delta_rows=None if delta_rows is None else as_t(delta_rows, torch.int64),
    )
