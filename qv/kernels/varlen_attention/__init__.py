"""Attention within each packed sequence, no cache (the vision tower)."""

from __future__ import annotations

import torch

from qv.kernels.registry import impl


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float,
                     causal: bool = False, max_seqlen: int | None = None) -> torch.Tensor:
    """Attention within each packed sequence, no cache. q [T, Hq, D], k/v [T, Hkv, D]; returns [T, Hq, D]."""
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[1] % k.shape[1]:
        raise ValueError(f"varlen_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    return impl("varlen_attention", q.device)(q, k, v, cu_seqlens, scale, causal, max_seqlen)
