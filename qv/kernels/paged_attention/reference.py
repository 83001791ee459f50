"""fp32 attention over the paged cache with exact softmax: the oracle of paged_attention (arguments as in
__init__.py). It reads every key from the cache (k_new / v_new repeat what the cache holds)."""

from __future__ import annotations

import torch


def gather_kv(cache, scale, block_table, length):
    """fp32 [length, Hkv, D] of one sequence's keys or values from the paged cache."""
    block_size = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    blk = block_table[pos // block_size].long()
    off = pos % block_size
    vals = cache[blk, off].float()
    if cache.dtype == torch.int8:
        vals = vals * scale[blk, off].float()[..., None]
    return vals


def paged_attention(
    q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale,
    k_scale=None, v_scale=None, max_query_len=None, max_seq_len=None, k_new=None, v_new=None, keep=None,
    block_tokens=None,
):
    # k_new / v_new repeat what the cache holds (a kernel may read them instead): the oracle reads the cache.
    # keep [T, Hq, NB] (sparse attention): each row and query head sees only the keys of its kept blocks of
    # block_tokens keys (dropped keys are -inf before the softmax, so keeping all is dense bit for bit)
    hq, hkv, d = q.shape[1], k_cache.shape[2], q.shape[2]
    rep = hq // hkv
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    cu = cu_seqlens_q.tolist()
    for i, (s, e) in enumerate(zip(cu, cu[1:])):
        if e == s:
            continue
        n, L = int(seq_lens[i]), e - s
        keys = gather_kv(k_cache, k_scale, block_tables[i], n).permute(1, 2, 0)  # [Hkv, D, n]
        vals = gather_kv(v_cache, v_scale, block_tables[i], n).transpose(0, 1)  # [Hkv, n, D]
        # query head h reads kv head h // rep: group the rep query heads of each kv head as rows
        qf = q[s:e].float().view(L, hkv, rep, d).permute(1, 2, 0, 3).reshape(hkv, rep * L, d)
        scores = (qf @ keys) * scale  # [Hkv, rep*L, n]
        qpos = torch.arange(n - L, n, device=q.device).repeat(rep)
        hidden = (torch.arange(n, device=q.device)[None, :] > qpos[:, None])[None]  # key after query
        if keep is not None:
            kept = keep[s:e].view(L, hkv, rep, -1).permute(1, 2, 0, 3).reshape(hkv, rep * L, -1)
            hidden = hidden | ~kept[..., torch.arange(n, device=q.device) // block_tokens]  # [Hkv, rep*L, n]
        p = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
        o = (p @ vals).view(hkv, rep, L, d).permute(2, 0, 1, 3).reshape(L, hq, d)
        out[s:e] = o.to(q.dtype)
    return out
