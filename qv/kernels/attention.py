"""Attention over the paged KV cache (prefill chunks, decode and speculative rows alike), the
cache write (with int8 quantization), and dense varlen attention for the vision tower."""

from __future__ import annotations

import torch

from qv.kernels.registry import impl


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Store new keys/values in the paged cache. k, v [T, Hkv, D]; caches [NB, BS, Hkv, D];
    slot_mapping [T] (block * BS + offset; -1 skips the row). int8 caches quantize symmetrically
    with one fp32 scale per (token, head) written to k_scale/v_scale [NB, BS, Hkv]."""
    if k.shape != v.shape or k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"write_kv: k {tuple(k.shape)}, v {tuple(v.shape)}, cache {tuple(k_cache.shape)}")
    if k_cache.dtype == torch.int8 and (k_scale is None or v_scale is None):
        raise ValueError("write_kv: an int8 cache needs k_scale and v_scale tables")
    impl("write_kv", k.device)(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                    max_query_len: int | None = None, max_seq_len: int | None = None) -> torch.Tensor:
    """Causal GQA attention of packed queries over each sequence's cached keys (new ones included).

    q [T, Hq, D]; caches [NB, BS, Hkv, D] (+ int8 scales [NB, BS, Hkv]); block_tables [B, MB] int32;
    cu_seqlens_q [B+1] int32; seq_lens [B] int32 = keys of each sequence after this step. Query i
    of sequence b sits at position seq_lens[b] - q_len[b] + i and sees keys up to it, so decode
    (q_len 1), prefill chunks over a cached prefix and the k+1 speculative rows are one op.
    Returns [T, Hq, D].
    """
    if q.shape[1] % k_cache.shape[2] or q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"paged_attention: q {tuple(q.shape)} vs cache {tuple(k_cache.shape)}")
    return impl("paged_attention", q.device)(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                                             k_scale, v_scale, max_query_len, max_seq_len)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float,
                     causal: bool = False, max_seqlen: int | None = None) -> torch.Tensor:
    """Attention within each packed sequence, no cache. q [T, Hq, D], k/v [T, Hkv, D]; returns [T, Hq, D]."""
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[1] % k.shape[1]:
        raise ValueError(f"varlen_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    return impl("varlen_attention", q.device)(q, k, v, cu_seqlens, scale, causal, max_seqlen)
