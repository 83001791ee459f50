"""Grouped low-rank deltas: every row of a step that runs an adapter (a Clef record's LoRA + deabl,
a served LoRA adapter) gets its own slot's y[row] += ((x[row] A_s^T) * scale_s) B_s^T, for all slots
in one shrink launch and one expand launch per Linear (punica's SGMV / S-LoRA's layout: rows grouped
by slot, the slots' rank rows in one pool).

The bank (DeltaBankView) holds, per Linear, a pool of P rank rows. Rank row j is one rank of one
adapter module: A row a[j] [K], its scale, and its B column over the output columns of the module it
belongs to (member m of a fused Linear: columns [col[j], col[j] + width[j])), stored flat in b at
b_off[j]. A slot's rank rows are contiguous and sorted by member: slot_rows[s, m] is the first rank
row of member m in slot s, slot_rows[s, M] the end; member_cols [M+1] are the members' column bounds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qv.kernels.registry import impl


@dataclass(frozen=True)
class DeltaBankView:
    a: torch.Tensor  # [P, K] rank rows' A vectors
    b: torch.Tensor  # [W] every rank row's B column over its member's width, flat
    b_off: torch.Tensor  # [P] int64: where rank row j's B column starts in b
    col: torch.Tensor  # [P] int32: its first output column
    width: torch.Tensor  # [P] int32: its output columns (0 for a free rank row)
    scale: torch.Tensor  # [P] fp32
    slot_rows: torch.Tensor  # [S, M+1] int32: rank rows of member m of slot s = [slot_rows[s, m], slot_rows[s, m+1])
    member_cols: torch.Tensor  # [M+1] int32: output columns of member m = [member_cols[m], member_cols[m+1])
    max_slot_rank: int  # the most rank rows any slot may hold (the shrink's output width)
    b_align: int = 1  # a power of two (<= 8) dividing every b_off, col and width: B loads that wide


@dataclass(frozen=True)
class DeltaGroups:
    """A step's delta rows grouped by slot: rows[slot_start[s]:slot_start[s+1]] run slot s."""

    rows: torch.Tensor  # [R] int64 token rows of the flat batch
    slot_start: torch.Tensor  # [S+1] int32 or int64 (the step input field is int64)
    max_rows: int  # the most rows of any one slot (the launch grid)


def grouped_delta(y: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, slot_start: torch.Tensor | None,
                  max_rows: int, bank: DeltaBankView) -> torch.Tensor:
    """y[rows of slot s] += ((x[rows] a[J_s]^T) * scale[J_s]) B_s^T for every slot s (J_s its rank rows),
    other rows untouched; returns y (possibly in place).

    y [T, N] (unit inner stride), x [T, K], rows [R] int64 (distinct), slot_start [S+1] int32/int64 or None
    (every row runs slot 0), max_rows: the most rows in one slot (host-known; a bound is fine).
    """
    if bank.a.shape[1] != x.shape[-1] or int(bank.member_cols.shape[0]) != bank.slot_rows.shape[1]:
        raise ValueError(f"grouped_delta: x {tuple(x.shape)}, a {tuple(bank.a.shape)}, slot_rows "
                         f"{tuple(bank.slot_rows.shape)}, member_cols {tuple(bank.member_cols.shape)}")
    if slot_start is not None and slot_start.shape[0] - 1 > bank.slot_rows.shape[0]:
        raise ValueError(f"grouped_delta: {slot_start.shape[0] - 1} slots, the bank has {bank.slot_rows.shape[0]}")
    return impl("grouped_delta", x.device)(y, x, rows, slot_start, max_rows, bank)
