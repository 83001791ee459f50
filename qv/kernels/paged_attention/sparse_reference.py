"""Block-sparse attention over the paged cache, the original stack's long-context rules (docs/VALIDATION.md,
"Sparse attention"), in fp32 torch ops: the spec and oracle of the sparse kernels.

Keys are grouped in selection blocks of `block_tokens` positions (a whole number of cache pages). Each page
keeps two tables, refreshed when keys are written to it (update_page_stats, from write_kv's slot mapping):
its mean key and, per dimension, the largest distance of one of its keys from that mean (dev). block_stats
builds a block's from its pages'; the layers keep them at write time instead (update_block_stats, read by
block_stats_at_last_pages, equal bit for bit). A block's
score for a query q is q . mean + gamma * sum_d |q_d| dev_d: gamma 1 bounds every key's score in the block
from above (Hoelder), gamma 0 is the mean key's score, which by Jensen gives a lower bound of the block's
softmax mass (n * exp(q . mean) <= sum of exp(q . k)); the original runs gamma 0.5.

- Prefill (select_prefill): per query tile and KV head, each row's estimated block masses are normalised
  to sum 1 (so no row dominates), averaged over the tile's rows and query heads, and blocks are kept in
  decreasing estimated mass until the kept share reaches `mass`. The sink blocks, the window of blocks
  before the tile and the blocks the tile's own rows reach (the diagonal) are always kept. Sequences
  shorter than `min_len` keys stay dense, and mass >= 1 keeps every block.
- Decode (select_decode): per row (speculative rows too) and per query head, the top fraction `top` of
  the blocks the row sees by score, at least `min_blocks` (so short contexts are dense by themselves),
  plus sink and recent blocks. Fixed shapes and no host read: it can be captured in a CUDA graph.

Both return `keep` [T, Hq, NBsel] bool (row, query head, selection block); sparse_paged_attention is exact
softmax attention over the kept blocks' keys only (causal, as paged_attention). Block b of a sequence
holds positions b * block_tokens ... (b + 1) * block_tokens - 1.
"""

from __future__ import annotations

import math

import torch

from qv.kernels.paged_attention import reference
from qv.kernels.paged_attention.reference import gather_kv


def new_page_stats(num_pages: int, hkv: int, d: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed (mean, dev) tables [num_pages + 1, Hkv, D] fp32; the last row is scratch for skipped rows."""
    return (torch.zeros(num_pages + 1, hkv, d, dtype=torch.float32, device=device),
            torch.zeros(num_pages + 1, hkv, d, dtype=torch.float32, device=device))


def update_page_stats(mean: torch.Tensor, dev: torch.Tensor, k_cache: torch.Tensor, k_scale: torch.Tensor | None,
                      slot_mapping: torch.Tensor) -> None:
    """Refresh the stats of every page a row of slot_mapping wrote, from the cache (after write_kv): over
    its rows 0 .. the highest offset the step wrote there (pages fill in order, so these are the
    sequence's keys). Every row of a page computes the same values, so duplicate writes agree; -1 rows
    (skipped, graph padding) write the scratch row. No host read: capturable in a CUDA graph."""
    bs, scratch = k_cache.shape[1], mean.shape[0] - 1
    keep = slot_mapping >= 0
    slots = torch.where(keep, slot_mapping, 0).long()
    page = torch.where(keep, slots // bs, scratch)
    top = torch.zeros(scratch + 1, dtype=torch.long, device=slots.device).scatter_reduce(
        0, page, slots % bs, "amax")  # the highest offset written to each page this step
    off = top[page]
    src = torch.where(keep, page, 0)
    keys = k_cache[src].float()  # [T, BS, Hkv, D]
    if k_cache.dtype == torch.int8:
        keys = keys * k_scale[src].float()[..., None]
    valid = (torch.arange(bs, device=keys.device)[None, :] <= off[:, None])[..., None, None]  # [T, BS, 1, 1]
    keys = torch.where(valid, keys, 0.)  # rows past the offset may hold a previous owner's keys
    m = keys.sum(1) / (off + 1).float()[:, None, None]  # [T, Hkv, D]
    spread = torch.where(valid, (keys - m[:, None]).abs(), 0.).amax(1)
    mean.index_put_((page,), m)
    dev.index_put_((page,), spread)


def _pages_per_block(block_tokens: int, page_size: int) -> int:
    if block_tokens % page_size:
        raise ValueError(f"sparse attention: block_tokens {block_tokens} is not a multiple of the page size "
                         f"{page_size}")
    return block_tokens // page_size


def _pool_pages(pm: torch.Tensor, pd: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A block's (mean, dev, keys) from its pages' tables pm, pd [..., per, Hkv, D] weighted by their keys
    w [..., per]: the mean weighs pages by keys; dev bounds each key's distance from it (the page's own dev plus
    the page mean's distance), so a bound stays a bound. One arithmetic for block_stats and update_block_stats,
    so the two agree bit for bit."""
    keys = w.sum(-1)
    bm = (pm * w[..., None, None]).sum(-3) / keys.clamp_min(1)[..., None, None]
    far = (pm - bm[..., None, :, :]).abs() + pd
    bd = torch.where((w > 0)[..., None, None], far, torch.zeros_like(far)).amax(-3)
    return bm, bd, keys


def block_stats(mean: torch.Tensor, dev: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                page_size: int, block_tokens: int, max_blocks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per sequence and selection block: (mean [B, NBsel, Hkv, D], dev [B, NBsel, Hkv, D], keys [B, NBsel])
    from its pages' tables (_pool_pages)."""
    per = _pages_per_block(block_tokens, page_size)
    b = block_tables.shape[0]
    pages = torch.arange(max_blocks * per, device=mean.device)
    cols = pages.clamp_max(block_tables.shape[1] - 1)
    phys = block_tables[:, cols].long()  # [B, NBsel * per]
    n = (seq_lens[:, None].long() - pages[None, :] * page_size).clamp(0, page_size).float()  # keys in each page
    pm, pd = mean[phys], dev[phys]  # [B, P, Hkv, D]
    return _pool_pages(pm.view(b, max_blocks, per, *pm.shape[2:]), pd.view(b, max_blocks, per, *pd.shape[2:]),
                       n.view(b, max_blocks, per))


def update_block_stats(block_mean: torch.Tensor, block_dev: torch.Tensor, mean: torch.Tensor, dev: torch.Tensor,
                       block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                       slot_mapping: torch.Tensor, page_size: int, block_tokens: int) -> None:
    """After update_page_stats: for the page each row of this step wrote, its selection block's (mean, dev) over
    the block's pages up to that page (block_stats's arithmetic on them), stored at that page in the [pages + 1,
    Hkv, D] tables. block_stats_at_last_pages then reads a block at its last page with keys instead of rebuilding
    it from every page each step. An entry depends only on the pages before it in its block, which prefix sharing
    keeps the same for every sequence holding the page. Rows of no sequence (-1 slots) write the scratch row; no
    host read, so it can be captured in a CUDA graph."""
    per = _pages_per_block(block_tokens, page_size)
    t, scratch = slot_mapping.shape[0], block_mean.shape[0] - 1
    seq, pos = _row_positions(cu_seqlens_q, seq_lens, t)
    seq = seq.clamp_max(block_tables.shape[0] - 1)  # graph padding past the batch's rows: written to scratch below
    page = pos.clamp_min(0) // page_size  # the row's logical page
    first = page // per * per
    j = torch.arange(per, device=pos.device)
    cols = (first[:, None] + j[None, :]).clamp_max(block_tables.shape[1] - 1)
    phys = block_tables[seq[:, None], cols].long()  # [T, per]
    n = (seq_lens.long()[seq][:, None] - (first[:, None] + j[None, :]) * page_size).clamp(0, page_size)
    w = torch.where(j[None, :] <= (page - first)[:, None], n, 0).float()  # the pages up to the row's own
    bm, bd, _ = _pool_pages(mean[phys], dev[phys], w)  # the pages' tables [T, per, Hkv, D]
    own = phys.gather(1, (page - first)[:, None]).squeeze(1)
    target = torch.where(slot_mapping >= 0, own, scratch)
    block_mean.index_put_((target,), bm)
    block_dev.index_put_((target,), bd)


def block_stats_at_last_pages(block_mean: torch.Tensor, block_dev: torch.Tensor, block_tables: torch.Tensor,
                              seq_lens: torch.Tensor, page_size: int, block_tokens: int,
                              max_blocks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """block_stats's (mean [B, NBsel, Hkv, D], dev, keys [B, NBsel]) read from update_block_stats' entries: each
    block's at its last page holding keys; blocks without keys are zero, as block_stats makes them."""
    per = _pages_per_block(block_tokens, page_size)
    blk = torch.arange(max_blocks, device=block_tables.device)[None, :]
    keys = (seq_lens.long()[:, None] - blk * block_tokens).clamp(0, block_tokens)  # [B, NBsel]
    last = (blk * per + (keys + page_size - 1) // page_size - 1).clamp(0, block_tables.shape[1] - 1)
    phys = block_tables.long().gather(1, last)
    has = (keys > 0)[..., None, None]
    bm = torch.where(has, block_mean[phys], torch.zeros((), device=block_mean.device))
    bd = torch.where(has, block_dev[phys], torch.zeros((), device=block_dev.device))
    return bm, bd, keys.float()


def _row_positions(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, position) of each of the t packed query rows."""
    rows = torch.arange(t, device=cu_seqlens_q.device)
    seq = torch.searchsorted(cu_seqlens_q[1:].long(), rows, right=True)
    q_len = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()[seq]
    pos = seq_lens.long()[seq] - q_len + (rows - cu_seqlens_q.long()[seq])
    return seq, pos


def block_scores(q: torch.Tensor, seq: torch.Tensor, bm: torch.Tensor, bd: torch.Tensor, gamma: float,
                 spans: list[tuple[int, int]] | None = None) -> torch.Tensor:
    """[T, Hq, NBsel] scores q . mean + gamma * sum_d |q_d| dev_d of every row and query head against its
    sequence's blocks (unscaled). spans (host ints: each sequence's rows [s, e)) scores each sequence's
    rows against its blocks at once (prompt chunks); without, each row gathers its own (decode, no host read)."""
    t, hq, d = q.shape
    hkv = bm.shape[2]
    qf = q.float().view(t, hkv, hq // hkv, d)
    if spans is None:
        m, dv = bm[seq], bd[seq]  # [T, NB, Hkv, D]
        s = torch.einsum("tgrd,tngd->tgrn", qf, m)
        if gamma:
            s = s + gamma * torch.einsum("tgrd,tngd->tgrn", qf.abs(), dv)
        return s.reshape(t, hq, -1)
    out = torch.empty(t, hkv, hq // hkv, bm.shape[1], device=q.device)
    for b, (lo, hi) in enumerate(spans):
        if hi > lo:
            out[lo:hi] = torch.einsum("tgrd,ngd->tgrn", qf[lo:hi], bm[b])
            if gamma:
                out[lo:hi] += gamma * torch.einsum("tgrd,ngd->tgrn", qf[lo:hi].abs(), bd[b])
    return out.reshape(t, hq, -1)


def forced_blocks(pos: torch.Tensor, first: torch.Tensor, block_tokens: int, nb: int, sink: int,
                  window: int) -> torch.Tensor:
    """[T, NBsel] blocks always kept for rows at `pos` whose tile starts at position `first`: the first
    `sink`, the `window` blocks before the tile's first block, and every block from there to the row's own."""
    blk = torch.arange(nb, device=pos.device)[None, :]
    lo = (first // block_tokens - window)[:, None]
    return (blk < sink) | ((blk >= lo) & (blk <= (pos // block_tokens)[:, None]))


def select_prefill(q: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, bm: torch.Tensor,
                   bd: torch.Tensor, block_keys: torch.Tensor, scale: float, block_tokens: int, mass: float = 0.85,
                   gamma: float = 0.5, tile: int = 128, sink: int = 2, window: int = 8,
                   min_len: int = 0, rule: str = "certified", row_chunk: int = 1024) -> torch.Tensor:
    """keep [T, Hq, NBsel] of prompt rows by the mass rule (module docstring). Rows are tiled per
    sequence from its first row of the step (tile rows); every row of a tile and every query head of
    one KV head share the tile's choice. Blocks are ranked by the estimated tile mass (gamma's score);
    where the ranking stops:
    - "estimate" (the original's): once the kept blocks' estimated mass reaches `mass`;
    - "certified": once a lower bound of the kept share of the exact mass, averaged over the tile's rows
      and query heads, reaches `mass`: per row, kept whole blocks count at their Jensen bound
      n * exp(q . mean), every dropped block at its Hoelder bound n * exp(q . mean + sum_d |q_d| dev_d),
      so the captured share per tile is at least `mass` whatever the keys (at the cost of keeping more).
    row_chunk: more rows than this are selected in pieces of whole tiles of one sequence (the same choice,
    with temporaries of [row_chunk, Hq, NBsel] instead of [T, Hq, NBsel])."""
    if rule not in ("certified", "estimate"):
        raise ValueError(f"select_prefill: rule {rule!r} is not certified or estimate")
    t, hq, _ = q.shape
    if t > row_chunk:
        step = max(tile, row_chunk // tile * tile)
        cu = cu_seqlens_q.tolist()
        pieces = []
        for b, (lo, hi) in enumerate(zip(cu, cu[1:])):
            for start in range(lo, hi, step):
                end = min(hi, start + step)
                # the piece as a sequence of its own: its rows end (hi - end) keys before the sequence's end
                piece_len = (seq_lens[b:b + 1] - (hi - end)).to(seq_lens.dtype)
                one = torch.tensor([0, end - start], dtype=cu_seqlens_q.dtype, device=q.device)
                pieces.append(select_prefill(q[start:end], one, piece_len, bm[b:b + 1], bd[b:b + 1],
                                             block_keys[b:b + 1], scale, block_tokens, mass, gamma, tile, sink, window,
                                             min_len - (hi - end), rule, row_chunk))  # dense by the whole length
        return torch.cat(pieces) if pieces else torch.zeros(0, hq, bm.shape[1], dtype=torch.bool, device=q.device)
    nb, hkv = bm.shape[1], bm.shape[2]
    rep = hq // hkv
    seq, pos = _row_positions(cu_seqlens_q, seq_lens, t)
    cu = cu_seqlens_q.tolist()
    spans = list(zip(cu, cu[1:]))
    local = torch.arange(t, device=q.device) - cu_seqlens_q.long()[seq]
    tile_id = seq * (1 << 32) + local // tile  # unique per (sequence, tile)
    _, inverse = torch.unique(tile_id, return_inverse=True)
    num_tiles = int(inverse.max()) + 1 if t else 0
    first_pos = torch.full((num_tiles,), 1 << 62, dtype=torch.long, device=q.device).scatter_reduce(
        0, inverse, pos, "amin")
    first_row = first_pos[inverse]
    forced = forced_blocks(pos, first_row, block_tokens, nb, sink, window)  # [T, NB]
    visible = torch.arange(nb, device=q.device)[None, :] <= (pos // block_tokens)[:, None]
    est = block_scores(q, seq, bm, bd, gamma, spans) * scale + block_keys[seq].clamp_min(1).log()[:, None, :]
    est = est.masked_fill(~visible[:, None, :], float("-inf"))
    share = torch.softmax(est, dim=-1)  # [T, Hq, NB]: each row's estimated mass, normalised per row
    # tile mass per KV head: mean over the tile's rows and the head's query heads
    share = share.view(t, hkv, rep, nb).mean(2)
    tile_mass = torch.zeros(num_tiles, hkv, nb, device=q.device).index_add_(0, inverse, share)
    rows_in_tile = torch.zeros(num_tiles, device=q.device).index_add_(0, inverse, torch.ones(t, device=q.device))
    tile_mass = tile_mass / rows_in_tile[:, None, None]
    tile_forced = torch.zeros(num_tiles, nb, device=q.device).index_add_(0, inverse, forced.float()) > 0
    ranked = tile_mass.masked_fill(tile_forced[:, None, :], float("inf"))
    order = torch.argsort(ranked, dim=-1, descending=True)
    if rule == "estimate":
        sorted_mass = torch.gather(tile_mass, -1, order)
        before = sorted_mass.cumsum(-1) - sorted_mass  # mass kept before each block in that order
    else:
        before = _certified_before(q, seq, bm, bd, block_keys, scale, pos, block_tokens, order, inverse, num_tiles,
                                   rows_in_tile, spans)
    take = (before < mass) | torch.gather(tile_forced[:, None, :].expand_as(order), -1, order)
    keep_tile = torch.zeros_like(take).scatter_(-1, order, take)  # [tiles, Hkv, NB]
    keep = keep_tile[inverse].repeat_interleave(rep, dim=1)  # [T, Hq, NB]
    dense = (seq_lens.long()[seq] < min_len) | (mass >= 1.0)
    return (keep | dense[:, None, None]) & visible[:, None, :]


def _certified_before(q, seq, bm, bd, block_keys, scale, pos, block_tokens, order, inverse, num_tiles, rows_in_tile,
                      spans):
    """[tiles, Hkv, NB]: for each prefix of each tile's order, the tile's mean (over rows and query heads)
    lower bound of the exact share its blocks before that place capture (see select_prefill)."""
    t, hq, _ = q.shape
    nb, hkv = bm.shape[1], bm.shape[2]
    rep = hq // hkv
    blk = torch.arange(nb, device=q.device)[None, :]
    whole = blk < ((pos + 1) // block_tokens)[:, None]  # blocks every key of which the row sees
    seen = blk <= (pos // block_tokens)[:, None]
    log_n = block_keys[seq].clamp_min(1).log()[:, None, :]
    low = (block_scores(q, seq, bm, bd, 0.0, spans) * scale + log_n).masked_fill(~whole[:, None, :], float("-inf"))
    high = (block_scores(q, seq, bm, bd, 1.0, spans) * scale + log_n).masked_fill(~seen[:, None, :], float("-inf"))
    top = high.amax(-1, keepdim=True)
    low, high = (low - top).exp(), (high - top).exp()  # [T, Hq, NB], one scale per row
    row_order = order[inverse].repeat_interleave(rep, dim=1)  # [T, Hq, NB]
    low_ranked = torch.gather(low, -1, row_order)
    low_before = low_ranked.cumsum(-1) - low_ranked
    # dropped from each place on: a suffix sum (a total less a prefix cancels where one block dominates)
    high_from = torch.gather(high, -1, row_order).flip(-1).cumsum(-1).flip(-1)
    share = low_before / (low_before + high_from).clamp_min(1e-30)
    share = share.view(t, hkv, rep, nb).mean(2)
    tile_share = torch.zeros(num_tiles, hkv, nb, device=q.device).index_add_(0, inverse, share)
    return tile_share / rows_in_tile[:, None, None]


def select_decode(q: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, bm: torch.Tensor,
                  bd: torch.Tensor, block_tokens: int, top: float = 0.15, min_blocks: int = 256,
                  gamma: float = 0.5, sink: int = 2, recent: int = 2) -> torch.Tensor:
    """keep [T, Hq, NBsel] of decode and speculative rows: per row and query head the
    min(visible, max(min_blocks, ceil(top * visible))) best-scored blocks, sink and recent blocks first."""
    t, hq, _ = q.shape
    nb = bm.shape[1]
    seq, pos = _row_positions(cu_seqlens_q, seq_lens, t)
    last = pos // block_tokens
    blk = torch.arange(nb, device=q.device)[None, :]
    visible = blk <= last[:, None]
    forced = (blk < sink) | ((blk > last[:, None] - recent) & visible)
    nvis = last + 1
    k = torch.minimum(nvis, torch.maximum(torch.full_like(nvis, min_blocks), torch.ceil(nvis * top).long()))
    s = block_scores(q, seq, bm, bd, gamma)
    s = s.masked_fill(forced[:, None, :], float("inf")).masked_fill(~visible[:, None, :], float("-inf"))
    rank = torch.argsort(torch.argsort(s, dim=-1, descending=True, stable=True), dim=-1)
    return (rank < k[:, None, None]) & visible[:, None, :]


def sparse_paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, keep: torch.Tensor,
                           block_tokens: int, k_scale=None, v_scale=None) -> torch.Tensor:
    """Causal GQA attention, each row and query head over the keys of its kept blocks only (keep [T, Hq,
    NBsel]): reference.paged_attention with the keep mask, so every block kept is the dense result bit for bit."""
    return reference.paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, k_scale,
                                     v_scale, keep=keep, block_tokens=block_tokens)


def captured_mass(q, k_cache, block_tables, cu_seqlens_q, seq_lens, scale, keep: torch.Tensor, block_tokens: int,
                  k_scale=None) -> torch.Tensor:
    """[T, Hq] share of each row's exact softmax mass that falls in its kept blocks (the oracle's measure)."""
    hq, hkv, d = q.shape[1], k_cache.shape[2], q.shape[2]
    rep = hq // hkv
    out = torch.zeros(q.shape[:2], dtype=torch.float32, device=q.device)
    cu = cu_seqlens_q.tolist()
    for i, (s, e) in enumerate(zip(cu, cu[1:])):
        if e == s:
            continue
        n, L = int(seq_lens[i]), e - s
        keys = gather_kv(k_cache, k_scale, block_tables[i], n).permute(1, 2, 0)
        qf = q[s:e].float().view(L, hkv, rep, d).permute(1, 2, 0, 3).reshape(hkv, rep * L, d)
        scores = (qf @ keys) * scale
        qpos = torch.arange(n - L, n, device=q.device).repeat(rep)
        hidden = torch.arange(n, device=q.device)[None, :] > qpos[:, None]
        p = torch.softmax(scores.masked_fill(hidden[None], float("-inf")), dim=-1)
        kept = keep[s:e].view(L, hkv, rep, -1).permute(1, 2, 0, 3).reshape(hkv, rep * L, -1)
        share = (p * kept[..., torch.arange(n, device=q.device) // block_tokens]).sum(-1)  # [Hkv, rep*L]
        out[s:e] = share.view(hkv, rep, L).permute(2, 0, 1).reshape(L, hq)
    return out


def num_blocks(max_seq_len: int, block_tokens: int) -> int:
    return max(1, math.ceil(max_seq_len / block_tokens))
