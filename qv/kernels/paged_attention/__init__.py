"""Causal GQA attention of packed queries over the paged KV cache: prefill chunks, decode and speculative
rows alike."""

from __future__ import annotations

import torch

from qv.kernels.registry import impl


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                    max_query_len: int | None = None, max_seq_len: int | None = None,
                    k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None) -> torch.Tensor:
    """Causal GQA attention of packed queries over each sequence's cached keys (new ones included).

    q [T, Hq, D]; caches [NB, BS, Hkv, D] (+ int8 scales [NB, BS, Hkv]); block_tables [B, MB] int32;
    cu_seqlens_q [B+1] int32; seq_lens [B] int32 = keys of each sequence after this step. Query i
    of sequence b sits at position seq_lens[b] - q_len[b] + i and sees keys up to it, so decode
    (q_len 1), prefill chunks over a cached prefix and the k+1 speculative rows are one op.
    Returns [T, Hq, D].

    max_query_len / max_seq_len: host ints, upper bounds of the query lengths and of seq_lens (each
    computed with a device->host sync when omitted). Decode batches (max_query_len <= 8) split the
    context into a number of parts that depends only on B, the head counts and max_seq_len, and the
    programs past a sequence's own seq_lens[b] exit on the device. So a CUDA graph captured with a
    fixed B, max_query_len and an upper bound for max_seq_len (e.g. the model's max length) stays
    valid for every replay whose seq_lens stay under that bound; only block_tables, cu_seqlens_q,
    seq_lens and q change between replays (in place).

    k_new / v_new [T, Hkv, D] (optional): the keys and values this step wrote with write_kv, rows
    packed like q. They must equal what the cache holds for those positions; a kernel may read the
    chunk's own keys from them (contiguous) instead of from the pages. Ignored where the cache
    stores another dtype (int8).
    """
    if q.shape[1] % k_cache.shape[2] or q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"paged_attention: q {tuple(q.shape)} vs cache {tuple(k_cache.shape)}")
    if k_new is not None and (k_new.shape != (q.shape[0], *k_cache.shape[2:]) or v_new is None
                              or v_new.shape != k_new.shape):
        raise ValueError(f"paged_attention: k_new/v_new must be [T, Hkv, D] = {(q.shape[0], *k_cache.shape[2:])}")
    return impl("paged_attention", q.device)(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                                             k_scale, v_scale, max_query_len, max_seq_len, k_new, v_new)
