"""fp32 cache write: the oracle of write_kv (arguments as in __init__.py). int8 caches quantize each
(token, head) row symmetrically with one fp32 scale, rounding half to even."""

from __future__ import annotations

import torch

INT8_MAX = 127.0


def write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blk, off = slots // block_size, slots % block_size
    for src, cache, sc in ((k[keep], k_cache, k_scale), (v[keep], v_cache, v_scale)):
        if cache.dtype == torch.int8:
            xf = src.float()
            s = xf.abs().amax(-1).clamp_min(1e-30) / INT8_MAX  # [n, Hkv]
            cache[blk, off] = torch.round(xf / s[..., None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
            sc[blk, off] = s
        else:
            cache[blk, off] = src.to(cache.dtype)
