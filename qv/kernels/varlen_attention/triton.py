"""Triton varlen attention: the flash kernel of paged_attention/triton.py over packed K/V rows (no pages)."""

from __future__ import annotations

from qv.kernels.paged_attention.triton import attention


def varlen_attention(q, k, v, cu_seqlens, scale, causal=False, max_seqlen=None, *, config=None):
    if k.stride(-1) != 1 or k.stride() != v.stride():
        k, v = k.contiguous(), v.contiguous()
    return attention(q, k, v, None, None, None, cu_seqlens, None, scale, causal, False, max_seqlen, max_seqlen,
                     config)
