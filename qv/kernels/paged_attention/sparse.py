"""Block-sparse paged attention: each row and query head attends only to the key blocks its selection kept
(sparse_reference.py has the rules, the tables and the fp32 oracle). The Triton kernel is paged_attention's
own (triton.py) with a keep table: tiles that no row of a program keeps are skipped, and kept tiles mask the
keys of dropped blocks, so keeping every block gives the dense kernel's result. The sm70 chain has no
sparse kernel (its m8n8k4 prefill and decode kernels take no block lists): it is refused by name."""

from __future__ import annotations

import torch

from qv.kernels import registry
from qv.kernels.paged_attention import sparse_reference


class SparseAttentionUnavailable(NotImplementedError):
    """The active kernel chain has no sparse attention kernel."""


def sparse_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float, keep: torch.Tensor,
                           block_tokens: int, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                           max_query_len: int | None = None, max_seq_len: int | None = None) -> torch.Tensor:
    """paged_attention's arguments (qv/kernels/paged_attention/__init__.py) plus keep [T, Hq, NBsel] (bool or
    uint8: row, query head, block of block_tokens key positions) from sparse_reference.select_prefill /
    select_decode. Returns [T, Hq, D]."""
    t, hq, _ = q.shape
    if keep.shape[:2] != (t, hq) or keep.dim() != 3:
        raise ValueError(f"sparse_paged_attention: keep {tuple(keep.shape)} is not [T, Hq, NBsel] = [{t}, {hq}, ...]")
    if block_tokens < 1:
        raise ValueError(f"sparse_paged_attention: block_tokens must be positive, got {block_tokens}")
    backend = registry.chain_for(q.device)[0]
    if backend == "reference":
        return sparse_reference.sparse_paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                                                       keep.bool(), block_tokens, k_scale, v_scale)
    if backend == "sm70":
        raise SparseAttentionUnavailable(
            "sparse attention is not built for the sm70 kernel chain (its m8n8k4 attention kernels take no block "
            "lists): leave sparse attention off with kernels=sm70, or use kernels=triton")
    if not registry.triton_can_run(q.device):
        raise RuntimeError(f"sparse_paged_attention: the triton backend needs a CUDA device (or TRITON_INTERPRET=1 "
                           f"for CPU tests); inputs are on {q.device}")
    from qv.kernels.paged_attention import triton as triton_attention

    keep = keep.to(torch.uint8).contiguous()
    return triton_attention.attention(q, k_cache, v_cache, k_scale, v_scale, block_tables, cu_seqlens_q, seq_lens, scale,
                                      True, True, max_query_len, max_seq_len, None, None, None, keep, block_tokens)
