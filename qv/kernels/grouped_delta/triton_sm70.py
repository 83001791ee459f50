"""grouped_delta for the sm70 chain: the same Triton kernels with CUDA-core sums in place of tl.dot
(Triton has no tensor-core dot below sm_80, and >= 3.3 computes it wrong on sm_70)."""

from __future__ import annotations

from qv.kernels.grouped_delta.triton import grouped_delta as _grouped_delta


def grouped_delta(y, x, rows, slot_start, max_rows, bank):
    return _grouped_delta(y, x, rows, slot_start, max_rows, bank, dot=False)
