"""The paged KV cache write, with symmetric int8 quantization for int8 caches."""

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
