"""fp32 grouped low-rank delta: the oracle of grouped_delta (arguments as in __init__.py)."""

from __future__ import annotations

import torch


def grouped_delta(y, x, rows, slot_start, max_rows, bank):
    starts = [0, rows.numel()] if slot_start is None else slot_start.tolist()
    slot_rows, col, width, b_off = bank.slot_rows.tolist(), bank.col.tolist(), bank.width.tolist(), bank.b_off.tolist()
    out = y.float()
    for s in range(len(starts) - 1):
        r = rows[starts[s]:starts[s + 1]]
        lo, hi = slot_rows[s][0], slot_rows[s][-1]
        if r.numel() == 0 or hi == lo:
            continue
        t = (x[r].float() @ bank.a[lo:hi].float().t()) * bank.scale[lo:hi].float()  # [R_s, r]
        b_dense = torch.zeros(y.shape[-1], hi - lo, dtype=torch.float32, device=y.device)
        for j in range(lo, hi):
            b_dense[col[j]:col[j] + width[j], j - lo] = bank.b[b_off[j]:b_off[j] + width[j]].float()
        out = out.index_add(0, r, t @ b_dense.t())
    return out.to(y.dtype)
