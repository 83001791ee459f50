"""Block-sparse paged attention: each row and query head attends only to the key blocks its selection kept
(sparse_reference.py has the rules, the tables and the fp32 oracle). The Triton kernel is paged_attention's
own (triton.py) with a keep table: tiles that no row of a program keeps are skipped, and kept tiles mask the
keys of dropped blocks, so keeping every block gives the dense kernel's result. The sm70 chain has no
sparse kernel (its m8n8k4 prefill and decode kernels take no block lists): it is refused by name.

SparseKV is what an attention layer holds when the sparse_* levers are on: the page tables of its KV cache
and the policy; its `attend` runs after write_kv in place of paged_attention (qv/model/layers.py)."""

from __future__ import annotations

from dataclasses import dataclass

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
    return triton_attention.attention(q, k_cache, v_cache, k_scale, v_scale, block_tables, cu_seqlens_q, seq_lens,
                                      scale, True, True, max_query_len, max_seq_len, None, None, None, keep,
                                      block_tokens)


DECODE_ROWS = 8  # a step whose sequences have at most this many rows decodes (paged_attention's split)


@dataclass(frozen=True)
class SparsePolicy:
    """The sparse attention levers (qv/config.py sparse_*), as the attention layers use them."""

    prefill: bool = False
    decode: bool = False
    mass: float = 0.85
    rule: str = "certified"
    min_len: int = 16384
    top: float = 0.15
    min_blocks: int = 256
    block_tokens: int = 64
    tile: int = 128
    gamma: float = 0.5
    sink: int = 2
    window: int = 8
    recent: int = 2

    @property
    def enabled(self) -> bool:
        return self.prefill or self.decode


@dataclass
class SparseKV:
    """One attention layer's tables and the policy that reads them: each page's (mean, dev) of its keys
    (sparse_reference.update_page_stats) and, at each page, its selection block's (mean, dev) over the block's
    pages up to it (update_block_stats), which the selection reads instead of rebuilding every block each step."""

    policy: SparsePolicy
    mean: torch.Tensor  # [pages + 1, Hkv, D] fp32 (last row: scratch)
    dev: torch.Tensor
    block_mean: torch.Tensor  # [pages + 1, Hkv, D] fp32, the block's up to this page
    block_dev: torch.Tensor

    @classmethod
    def allocate(cls, policy: SparsePolicy, num_pages: int, hkv: int, d: int, device) -> "SparseKV":
        return cls(policy, *sparse_reference.new_page_stats(num_pages, hkv, d, device),
                   *sparse_reference.new_page_stats(num_pages, hkv, d, device))

    @staticmethod
    def bytes_per_page(hkv: int, d: int) -> int:
        return 4 * hkv * d * 4

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale, v_scale,
               slot_mapping: torch.Tensor, block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
               seq_lens: torch.Tensor, max_query_len: int, max_seq_len: int, scale: float) -> torch.Tensor | None:
        """After write_kv: refresh the tables from this step's writes (always, so they stay fresh whatever
        runs), then the sparse attention of the step, or None where the policy leaves it dense (the lever
        off for this kind of step, a prompt below min_len keys)."""
        p, page_size = self.policy, k_cache.shape[1]
        sparse_reference.update_page_stats(self.mean, self.dev, k_cache, k_scale, slot_mapping)
        sparse_reference.update_block_stats(self.block_mean, self.block_dev, self.mean, self.dev, block_tables,
                                            cu_seqlens_q, seq_lens, slot_mapping, page_size, p.block_tokens)
        decode = max_query_len <= DECODE_ROWS
        if not (p.decode if decode else p.prefill) or (not decode and max_seq_len < p.min_len):
            return None
        nb = sparse_reference.num_blocks(max_seq_len, p.block_tokens)
        bm, bd, keys = sparse_reference.block_stats_at_last_pages(self.block_mean, self.block_dev, block_tables,
                                                                  seq_lens, page_size, p.block_tokens, nb)
        if decode:
            keep = sparse_reference.select_decode(q, cu_seqlens_q, seq_lens, bm, bd, p.block_tokens, p.top,
                                                  p.min_blocks, p.gamma, p.sink, p.recent)
        else:
            keep = sparse_reference.select_prefill(q, cu_seqlens_q, seq_lens, bm, bd, keys, scale, p.block_tokens,
                                                   p.mass, p.gamma, p.tile, p.sink, p.window, p.min_len, p.rule)
        return sparse_paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, keep,
                                      p.block_tokens, k_scale, v_scale, max_query_len, max_seq_len)
