"""The per-row low-rank delta: y[rows] += (x[rows] A^T) B^T * scale (Clef rows' adapters)."""

from __future__ import annotations

import torch

from qv.kernels.registry import impl


def lora_delta(y: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               scale: float) -> torch.Tensor:
    """y[rows] += (x[rows] A^T) B^T * scale, other rows untouched; returns y (possibly in place).

    y [T, N], x [T, K], rows [R] int64 (row indices), a [r, K], b [N, r].
    """
    if a.shape[1] != x.shape[-1] or b.shape[0] != y.shape[-1] or a.shape[0] != b.shape[1]:
        raise ValueError(f"lora_delta: x {tuple(x.shape)}, y {tuple(y.shape)}, a {tuple(a.shape)}, b {tuple(b.shape)}")
    return impl("lora_delta", x.device)(y, x, rows, a, b, scale)
