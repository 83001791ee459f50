"""fp32 attention within each packed sequence with exact softmax: the oracle of varlen_attention."""

from __future__ import annotations

import torch


def varlen_attention(q, k, v, cu_seqlens, scale, causal=False, max_seqlen=None):
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    rep = q.shape[1] // k.shape[1]
    cu = cu_seqlens.tolist()
    for s, e in zip(cu, cu[1:]):
        qf, kf, vf = q[s:e].float(), k[s:e].float().repeat_interleave(rep, 1), v[s:e].float().repeat_interleave(rep, 1)
        scores = torch.einsum("lhd,nhd->hln", qf, kf) * scale
        if causal:
            n = e - s
            scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)[None], float("-inf"))
        out[s:e] = torch.einsum("hln,nhd->lhd", torch.softmax(scores, -1), vf).to(q.dtype)
    return out
