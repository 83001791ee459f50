"""The sm70 chain's varlen attention (the vision tower's): torch's scaled_dot_product_attention per packed
sequence. Its fused kernels (memory-efficient attention, built for sm_50 and newer) run on Volta, where the
Triton flash kernel's tl.dot has no tensor-core path; the vision tower's sequences are few and long, so one
call each costs little."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def varlen_attention(q, k, v, cu_seqlens, scale, causal=False, max_seqlen=None):
    out = torch.empty_like(q)
    rep = q.shape[1] // k.shape[1]
    cu = cu_seqlens.tolist()
    for s, e in zip(cu, cu[1:]):
        if e == s:
            continue
        qs = q[s:e].transpose(0, 1)[None]  # [1, Hq, L, D]
        ks = k[s:e].repeat_interleave(rep, 1).transpose(0, 1)[None]
        vs = v[s:e].repeat_interleave(rep, 1).transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale)
        out[s:e] = o[0].transpose(0, 1)
    return out
