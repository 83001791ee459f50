"""NeoX-style rotary embedding of q and k, partial and multimodal (mRoPE)."""

from __future__ import annotations

import torch

from qv.kernels.registry import impl


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rotary_dim: int, theta: float,
         mrope_section: tuple[int, ...] | None = None, mrope_interleaved: bool = False):
    """NeoX-style rotary on the first `rotary_dim` dims of each head; returns (q, k).

    q [T, Hq, D], k [T, Hk, D]; positions [T] (1-D) or [3, T] (t, h, w) for mRoPE, where
    `mrope_section` splits the rotary_dim/2 frequency slots between t, h and w (interleaved
    THWTHW... when `mrope_interleaved`). Implementations may rotate q and k in place.
    """
    t = q.shape[0]
    if k.shape[0] != t or positions.shape[-1] != t or positions.dim() not in (1, 2):
        raise ValueError(f"rope: q {tuple(q.shape)}, k {tuple(k.shape)}, positions {tuple(positions.shape)}")
    if rotary_dim > q.shape[-1] or rotary_dim % 2:
        raise ValueError(f"rope: rotary_dim {rotary_dim} must be even and <= head_dim {q.shape[-1]}")
    return impl("rope", q.device)(q, k, positions, rotary_dim, theta, mrope_section, mrope_interleaved)
