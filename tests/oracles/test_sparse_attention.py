"""Block-sparse attention (qv/kernels/paged_attention/sparse_reference.py, issue 35), on the CPU at tiny shapes:

- the page tables a write refreshes equal the page's keys' mean and per-dimension spread recomputed from
  scratch, for every sequence of a batch (the original's stale-means bug refreshed only the first);
- the identity gate: mass 1.0 (prefill) and top 1.0 (decode) keep every block and equal dense attention
  bit for bit;
- the mass rule captures at least the target share of the exact softmax mass per tile (the mean over its
  rows and query heads), on random and structured keys; the same measure with the legacy mean-only score
  (gamma 0) is reported beside it;
- a key block made to dominate one query's softmax is always selected (prefill tile and decode row);
- a decode batch where only the second sequence's keys change selects that sequence's new block.
Fresh seeded inputs every run (conftest seeds; `pytest --seed`)."""

from __future__ import annotations

import random

import pytest
import torch

from kernel_cases import cu_seqlens, paged_layout, run_reference, slots_for
from qv import kernels as K
from qv.kernels.paged_attention import sparse_reference as S
from qv.kernels.paged_attention.reference import gather_kv, paged_attention

DEV = torch.device("cpu")
PAGE = 4
BLOCK_TOKENS = 8  # two pages per selection block
MASS = 0.85


def _cache(seq_lens, hkv, d, keys=None, kv_dtype=torch.float32):
    """Caches holding each sequence's keys/values (reference write_kv) and their page tables."""
    bt, tables, nb = paged_layout(seq_lens, PAGE)
    bt = bt.to(DEV)
    n = sum(seq_lens)
    k = torch.randn(n, hkv, d) if keys is None else keys
    v = torch.randn(n, hkv, d)
    kc = torch.zeros(nb, PAGE, hkv, d, dtype=kv_dtype)
    vc = torch.zeros_like(kc)
    ks = vs = None
    if kv_dtype == torch.int8:
        ks, vs = torch.zeros(nb, PAGE, hkv), torch.zeros(nb, PAGE, hkv)
    slots = slots_for(tables, [0] * len(seq_lens), seq_lens, PAGE).to(DEV)
    run_reference(K.write_kv, k, v, kc, vc, slots, ks, vs)
    mean, dev = S.new_page_stats(nb, hkv, d, DEV)
    S.update_page_stats(mean, dev, kc, ks, slots)
    return dict(k_cache=kc, v_cache=vc, k_scale=ks, v_scale=vs, bt=bt, tables=tables, mean=mean, dev=dev, nb=nb)


def _fresh_stats(c, seq_lens):
    """(mean, dev) of every used page recomputed from the cache: the oracle of update_page_stats."""
    out = {}
    for b, n in enumerate(seq_lens):
        keys = gather_kv(c["k_cache"], c["k_scale"], c["bt"][b], n)
        for p, page in enumerate(c["tables"][b]):
            rows = keys[p * PAGE:min(n, (p + 1) * PAGE)]
            if not len(rows):  # a page the sequence has not reached yet
                continue
            m = rows.mean(0)
            out[page] = (m, (rows - m).abs().amax(0))
    return out


def _stats(c, seq_lens, max_blocks):
    return S.block_stats(c["mean"], c["dev"], c["bt"], torch.tensor(seq_lens), PAGE, BLOCK_TOKENS, max_blocks)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8])
def test_page_stats_fresh_for_every_sequence(kv_dtype):
    """Prefill chunks then decode steps of three sequences (pages shuffled, a partly filled last page),
    the tables refreshed after each write: every page's (mean, dev) equals a recompute from the cache."""
    hkv, d = 2, 8
    lens = [13, 22, 7]
    c = _cache([n + 3 for n in lens], hkv, d, kv_dtype=kv_dtype)  # room for 3 decode steps
    c["mean"].zero_(), c["dev"].zero_()
    kc, vc, ks, vs = c["k_cache"], c["v_cache"], c["k_scale"], c["v_scale"]
    written = [0, 0, 0]
    for chunk in ([5, 9, 7], [8, 13, 0], [1, 1, 1], [1, 1, 1], [1, 1, 1]):
        starts, ends = written, [w + n for w, n in zip(written, chunk)]
        slots = slots_for(c["tables"], starts, ends, PAGE).to(DEV)
        t = slots.numel()
        run_reference(K.write_kv, torch.randn(t, hkv, d), torch.randn(t, hkv, d), kc, vc, slots, ks, vs)
        S.update_page_stats(c["mean"], c["dev"], kc, ks, torch.cat([slots, torch.tensor([-1])]))  # a padding row
        written = ends
        for page, (m, dv) in _fresh_stats(c, written).items():
            torch.testing.assert_close(c["mean"][page], m, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(c["dev"][page], dv, rtol=1e-6, atol=1e-6)


def test_block_stats_bound_every_key():
    """A selection block's dev bounds each of its keys' distance from its mean, per dimension (gamma 1 is
    a true upper bound of every key's score); its mean is the mean of its keys."""
    hkv, d, lens = 2, 8, [30, 17]
    c = _cache(lens, hkv, d)
    nb = S.num_blocks(max(lens), BLOCK_TOKENS)
    bm, bd, keys = _stats(c, lens, nb)
    for b, n in enumerate(lens):
        ks = gather_kv(c["k_cache"], None, c["bt"][b], n)
        for j in range(-(-n // BLOCK_TOKENS)):
            rows = ks[j * BLOCK_TOKENS:(j + 1) * BLOCK_TOKENS]
            assert keys[b, j] == rows.shape[0]
            torch.testing.assert_close(bm[b, j], rows.mean(0), rtol=1e-5, atol=1e-6)
            assert bool(((rows - bm[b, j]).abs() <= bd[b, j] + 1e-6).all())


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8])
def test_block_stats_kept_at_write_time_equal_a_rebuild(kv_dtype):
    """update_block_stats after every write, read at each block's last page, equals block_stats rebuilt from the
    page tables, bit for bit: prompt chunks that cross blocks, decode steps, an inert padding row (slot -1, as
    a replayed graph pads), and a second sequence whose first three pages (ending inside a block) are the
    first's, as a prefix-cache hit shares them, then its own."""
    hkv, d = 2, 8
    pages = torch.randperm(24).tolist()
    tables = [pages[:11], pages[:3] + pages[11:20]]  # sequence 1 holds sequence 0's pages 0-2 (12 tokens)
    kc = torch.zeros(24, PAGE, hkv, d, dtype=kv_dtype)
    vc = torch.zeros_like(kc)
    ks, vs = (torch.zeros(24, PAGE, hkv), torch.zeros(24, PAGE, hkv)) if kv_dtype == torch.int8 else (None, None)
    mean, dev = S.new_page_stats(24, hkv, d, DEV)
    blk_mean, blk_dev = S.new_page_stats(24, hkv, d, DEV)
    written = {0: 0, 1: 12}
    # (sequence, tokens) per step; sequence 1 joins once sequence 0 has written the shared pages
    steps = ([(0, 27)], [(0, 10), (1, 13)], [(0, 1), (1, 1)], [(1, 1), (0, 1)], [(0, 1), (1, 1)])
    for step in steps:
        batch = [b for b, _ in step]
        starts = [written[b] for b in batch]
        ends = [written[b] + n for b, n in step]
        slots = slots_for([tables[b] for b in batch], starts, ends, PAGE).to(DEV)
        slots = torch.cat([slots, torch.tensor([-1])])  # the padding sequence's one row
        t = slots.numel()
        k = torch.randn(t, hkv, d)
        run_reference(K.write_kv, k[:-1], torch.randn(t - 1, hkv, d), kc, vc, slots[:-1], ks, vs)
        for b, e in zip(batch, ends):
            written[b] = e
        width = max(len(x) for x in tables)
        bt = torch.tensor([tables[b] + [0] * (width - len(tables[b])) for b in batch] + [[pages[0]] * width],
                          dtype=torch.int32)
        sl = torch.tensor([written[b] for b in batch] + [1], dtype=torch.int32)
        cu = cu_seqlens([n for _, n in step] + [1]).to(DEV)
        S.update_page_stats(mean, dev, kc, ks, slots)
        S.update_block_stats(blk_mean, blk_dev, mean, dev, bt, cu, sl, slots, PAGE, BLOCK_TOKENS)
        nb = S.num_blocks(int(sl.max()), BLOCK_TOKENS)
        real = slice(0, len(batch))
        want = S.block_stats(mean, dev, bt[real], sl[real], PAGE, BLOCK_TOKENS, nb)
        got = S.block_stats_at_last_pages(blk_mean, blk_dev, bt[real], sl[real], PAGE, BLOCK_TOKENS, nb)
        for name, a, b in zip(("mean", "dev", "keys"), got, want):
            assert torch.equal(a, b), f"step {step}: block {name} kept at write time differs from a rebuild"
    # the check can fail: a block left stale (its last page's entry from before its latest key) is caught
    blk_mean[tables[1][(written[1] - 1) // PAGE]] += 1.0
    got = S.block_stats_at_last_pages(blk_mean, blk_dev, bt[real], sl[real], PAGE, BLOCK_TOKENS, nb)
    assert not torch.equal(got[0], want[0])


def _prefill_case(q_lens, ctx, hkv=2, rep=3, d=16, keys=None, q=None):
    lens = [a + b for a, b in zip(q_lens, ctx)]
    c = _cache(lens, hkv, d, keys=keys)
    q = torch.randn(sum(q_lens), hkv * rep, d) if q is None else q
    cu, sl = cu_seqlens(q_lens).to(DEV), torch.tensor(lens, dtype=torch.int32)
    nb = S.num_blocks(max(lens), BLOCK_TOKENS)
    bm, bd, nkeys = _stats(c, lens, nb)
    return c, q, cu, sl, bm, bd, nkeys


def _dense(c, q, cu, sl, scale):
    return paged_attention(q, c["k_cache"], c["v_cache"], c["bt"], cu, sl, scale, c["k_scale"], c["v_scale"])


def test_mass_one_and_top_one_equal_dense_bit_for_bit():
    c, q, cu, sl, bm, bd, nkeys = _prefill_case([40, 1, 23], [70, 90, 0])
    scale = q.shape[-1] ** -0.5
    keep = S.select_prefill(q, cu, sl, bm, bd, nkeys, scale, BLOCK_TOKENS, mass=1.0, tile=8, sink=1, window=1)
    sparse = S.sparse_paged_attention(q, c["k_cache"], c["v_cache"], c["bt"], cu, sl, scale, keep, BLOCK_TOKENS)
    assert torch.equal(sparse, _dense(c, q, cu, sl, scale))
    keep = S.select_decode(q, cu, sl, bm, bd, BLOCK_TOKENS, top=1.0, min_blocks=1, sink=1, recent=1)
    sparse = S.sparse_paged_attention(q, c["k_cache"], c["v_cache"], c["bt"], cu, sl, scale, keep, BLOCK_TOKENS)
    assert torch.equal(sparse, _dense(c, q, cu, sl, scale))
    # a real selection drops blocks and changes the output: the gate is not vacuous
    keep = S.select_prefill(q, cu, sl, bm, bd, nkeys, scale, BLOCK_TOKENS, mass=0.5, tile=8, sink=1, window=1,
                            rule="estimate")
    sparse = S.sparse_paged_attention(q, c["k_cache"], c["v_cache"], c["bt"], cu, sl, scale, keep, BLOCK_TOKENS)
    assert not torch.equal(sparse, _dense(c, q, cu, sl, scale))


def _structured_keys(n, hkv, d, kind):
    """Keys with structure real attention has: blocks drawn around a few shared directions (topics), a
    slowly drifting mean (position), or a few large-norm outlier blocks."""
    if kind == "random":
        return torch.randn(n, hkv, d)
    if kind == "topics":
        centers = torch.randn(6, hkv, d) * 2
        topic = torch.randint(0, 6, (-(-n // BLOCK_TOKENS),)).repeat_interleave(BLOCK_TOKENS)[:n]
        return centers[topic] + 0.5 * torch.randn(n, hkv, d)
    if kind == "drift":
        walk = torch.randn(n, hkv, d).cumsum(0) * 0.1
        return walk + torch.randn(n, hkv, d)
    if kind == "outliers":
        k = torch.randn(n, hkv, d)
        blocks = torch.randperm(-(-n // BLOCK_TOKENS))[:3]
        for j in blocks.tolist():
            k[j * BLOCK_TOKENS:(j + 1) * BLOCK_TOKENS] *= 4
        return k
    raise ValueError(kind)


def _tile_mass(mass_rows, q_lens, tile, hkv, rep):
    """Per (sequence, tile, KV head): the mean captured share over its rows and query heads."""
    out, start = [], 0
    for n in q_lens:
        for lo in range(0, n, tile):
            block = mass_rows[start + lo:start + min(n, lo + tile)].view(-1, hkv, rep)
            out.append(block.mean((0, 2)))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("kind", ["random", "topics", "drift", "outliers"])
def test_captured_mass_per_tile_at_least_the_target(kind):
    hkv, rep, d, tile = 2, 3, 32, 16
    q_lens, ctx = [48, 33], [400, 280]
    lens = [a + b for a, b in zip(q_lens, ctx)]
    keys = torch.cat([_structured_keys(n, hkv, d, kind) for n in lens])
    # queries near some keys of their own sequence (attention looks somewhere), plus noise
    q = torch.randn(sum(q_lens), hkv * rep, d)
    if kind != "random":
        anchors = keys[torch.randint(0, lens[0], (sum(q_lens),))].repeat_interleave(rep, dim=1)
        q = q * 0.5 + anchors
    c, q, cu, sl, bm, bd, nkeys = _prefill_case(q_lens, ctx, hkv, rep, d, keys=keys, q=q)
    scale = d ** -0.5
    results = {}
    visible = int(sum(((sl.repeat_interleave(torch.tensor(q_lens)) - torch.tensor(q_lens).repeat_interleave(
        torch.tensor(q_lens)) + _local(q_lens)) // BLOCK_TOKENS + 1).tolist()))
    for rule in ("certified", "estimate"):
        keep = S.select_prefill(q, cu, sl, bm, bd, nkeys, scale, BLOCK_TOKENS, mass=MASS, tile=tile, sink=1, window=2,
                                rule=rule)
        got = S.captured_mass(q, c["k_cache"], c["bt"], cu, sl, scale, keep, BLOCK_TOKENS)
        per_tile = _tile_mass(got, q_lens, tile, hkv, rep)
        results[rule] = (round(float(per_tile.min()), 3), round(float(keep[:, 0].sum()) / visible, 3))
    print(f"{kind}: (least tile mass, share of visible blocks kept): {results}")
    assert results["certified"][0] >= MASS  # a bound, whatever the keys
    assert results["estimate"][1] < 1.0  # the original's rule does drop blocks (its mass is measured, not bound)


def _local(q_lens):
    """Each packed row's index within its sequence's rows."""
    return torch.cat([torch.arange(n) for n in q_lens])


@pytest.mark.parametrize("rule", ["certified", "estimate"])
def test_planted_key_block_always_selected(rule):
    """One key of an old block (outside sink and window) made to dominate one query row's softmax, in
    each of 6 fresh cases: its block is kept for that row's tile and query head (prefill), and for that row
    as a decode row (min_blocks 1, top 10%)."""
    hkv, rep, d = 2, 3, 16
    for _ in range(6):
        q_lens, ctx = [24], [300]
        n = q_lens[0] + ctx[0]
        keys = torch.randn(n, hkv, d)
        q = torch.randn(q_lens[0], hkv * rep, d)
        row, head = random.randrange(q_lens[0]), random.randrange(hkv * rep)
        where = random.randrange(BLOCK_TOKENS * 2, ctx[0] - BLOCK_TOKENS * 4)
        keys[where, head // rep] = q[row, head] / q[row, head].norm() * 6 * d ** 0.5  # weight >> every other key
        c, q, cu, sl, bm, bd, nkeys = _prefill_case(q_lens, ctx, hkv, rep, d, keys=keys, q=q)
        scale = d ** -0.5
        p = torch.softmax(torch.einsum("d,nd->n", q[row, head], keys[:ctx[0] + row + 1, head // rep]) * scale, -1)
        assert p[where] > 0.5, "the planted key was meant to dominate"
        keep = S.select_prefill(q, cu, sl, bm, bd, nkeys, scale, BLOCK_TOKENS, mass=MASS, tile=8, sink=1, window=1,
                                rule=rule)
        assert keep[row, head, where // BLOCK_TOKENS]
        assert rule == "certified" or not bool(keep[row, head].all())  # the estimate rule drops blocks here
        one = cu_seqlens([1]).to(DEV)
        at = torch.tensor([ctx[0] + row + 1], dtype=torch.int32)
        keep = S.select_decode(q[row:row + 1], one, at, bm, bd, BLOCK_TOKENS, top=0.1, min_blocks=1, sink=1, recent=1)
        assert keep[0, head, where // BLOCK_TOKENS]


def test_decode_batch_where_only_the_second_sequences_keys_change():
    """Two sequences decode in one batch (sequence 0's row first, as the original's stale-means bug
    needed: it refreshed only the first request's means). Each step both write their new key and the
    tables are refreshed from that step's slot mapping; sequence 0's keys are ordinary, sequence 1's new
    keys point at its query. With no sink or recent block forced, sequence 1 must select its newest
    block by its refreshed mean alone; every page's stats equal a recompute from scratch; sequence 0's
    choice equals the one made from scratch too."""
    hkv, rep, d = 2, 2, 16
    lens = [200, 240]
    steps = 3
    c = _cache([n + steps for n in lens], hkv, d)
    c["mean"].zero_(), c["dev"].zero_()
    S.update_page_stats(c["mean"], c["dev"], c["k_cache"], None,
                        slots_for(c["tables"], [0, 0], lens, PAGE).to(DEV))  # the prompts' writes
    q = torch.randn(2, hkv * rep, d)
    scale = d ** -0.5
    nb = S.num_blocks(max(lens) + steps, BLOCK_TOKENS)
    args = dict(top=0.1, min_blocks=1, sink=0, recent=0)
    for step in range(steps):
        now = [n + step for n in lens]
        slots = slots_for(c["tables"], now, [n + 1 for n in now], PAGE).to(DEV)
        k_rows = torch.randn(2, hkv, d)
        k_rows[1] = (q[1] / q[1].norm(dim=-1, keepdim=True)).view(hkv, rep, d)[:, 0] * 6 * d ** 0.5
        run_reference(K.write_kv, k_rows, torch.randn(2, hkv, d), c["k_cache"], c["v_cache"], slots)
        S.update_page_stats(c["mean"], c["dev"], c["k_cache"], None, slots)
        sl = torch.tensor([n + 1 for n in now], dtype=torch.int32)
        cu = cu_seqlens([1, 1]).to(DEV)
        for page, (m, dv) in _fresh_stats(c, sl.tolist()).items():
            torch.testing.assert_close(c["mean"][page], m, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(c["dev"][page], dv, rtol=1e-6, atol=1e-6)
        keep = S.select_decode(q, cu, sl, *_stats(c, sl.tolist(), nb)[:2], BLOCK_TOKENS, **args)
        newest = int(sl[1] - 1) // BLOCK_TOKENS
        assert keep[1, ::rep, newest].all(), f"step {step}: sequence 1's new block was not selected"
        fresh = dict(c)
        fresh["mean"], fresh["dev"] = S.new_page_stats(c["nb"], hkv, d, DEV)
        S.update_page_stats(fresh["mean"], fresh["dev"], c["k_cache"], None,
                            slots_for(c["tables"], [0, 0], sl.tolist(), PAGE).to(DEV))
        assert torch.equal(keep, S.select_decode(q, cu, sl, *_stats(fresh, sl.tolist(), nb)[:2], BLOCK_TOKENS, **args))


@pytest.mark.parametrize("rule", ["certified", "estimate"])
def test_prefill_selection_in_row_pieces_is_the_same(rule):
    """More rows than row_chunk are selected in pieces of whole tiles: the same keep table, min_len included."""
    c, q, cu, sl, bm, bd, nkeys = _prefill_case([70, 5, 41], [200, 33, 300])
    scale = q.shape[-1] ** -0.5
    for min_len in (0, 250):
        args = (q, cu, sl, bm, bd, nkeys, scale, BLOCK_TOKENS)
        kw = dict(mass=MASS, tile=8, sink=1, window=1, min_len=min_len, rule=rule)
        whole = S.select_prefill(*args, **kw, row_chunk=1 << 20)
        assert torch.equal(S.select_prefill(*args, **kw, row_chunk=16), whole)
        assert torch.equal(S.select_prefill(*args, **kw, row_chunk=20), whole)  # rounded down to whole tiles


def test_decode_floor_keeps_short_contexts_dense():
    """k = min(visible, max(min_blocks, ceil(top * visible))): below min_blocks blocks every block is kept."""
    c, q, cu, sl, bm, bd, _ = _prefill_case([1, 1, 1], [30, 90, 200])
    keep = S.select_decode(q, cu, sl, bm, bd, BLOCK_TOKENS, top=0.15, min_blocks=12, sink=1, recent=1)
    visible = [(int(n) - 1) // BLOCK_TOKENS + 1 for n in sl]
    for r, nvis in enumerate(visible):
        want = min(nvis, max(12, -(-15 * nvis // 100)))
        assert (keep[r].sum(-1) == want).all(), (r, nvis, keep[r].sum(-1))


# ---------------------------------------------------------------------------------------------
# the Triton kernel with a keep table (CPU: the interpreter), against the fp32 sparse reference
# ---------------------------------------------------------------------------------------------


def _random_keep(q, cu, sl, nb, dense_share):
    """A keep table as a selection makes: each row's diagonal block kept, others kept at random."""
    t, hq, _ = q.shape
    seq, pos = S._row_positions(cu, sl, t)
    keep = torch.rand(t, hq, nb) < dense_share
    keep |= (torch.arange(nb)[None, :] == (pos // BLOCK_TOKENS)[:, None])[:, None, :]
    return keep


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8])
@pytest.mark.parametrize("q_lens,ctx", [([19, 1, 7], [60, 90, 0]), ([1, 4, 1], [130, 70, 9])],
                         ids=["prefill", "decode+spec"])
def test_triton_blocks_equal_the_sparse_reference(kv_dtype, q_lens, ctx):
    from kernel_cases import run_triton
    from qv.kernels.paged_attention.sparse import sparse_paged_attention

    hkv, rep, d = 2, 3, 16
    lens = [a + b for a, b in zip(q_lens, ctx)]
    c = _cache(lens, hkv, d, kv_dtype=kv_dtype)
    q = torch.randn(sum(q_lens), hkv * rep, d)
    cu, sl = cu_seqlens(q_lens).to(DEV), torch.tensor(lens, dtype=torch.int32)
    nb = S.num_blocks(max(lens), BLOCK_TOKENS)
    scale = d ** -0.5
    cache = (c["k_cache"], c["v_cache"], c["bt"], cu, sl, scale)
    scales = dict(k_scale=c["k_scale"], v_scale=c["v_scale"])
    for share in (1.0, 0.4, 0.0):
        keep = _random_keep(q, cu, sl, nb, share)
        want = S.sparse_paged_attention(q, *cache, keep, BLOCK_TOKENS, **scales)
        got = run_triton(sparse_paged_attention, q, *cache, keep, BLOCK_TOKENS, **scales,
                         max_query_len=max(q_lens), max_seq_len=max(lens))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        if share == 1.0:  # every block kept: the dense kernel's result
            dense = run_triton(K.paged_attention, q, c["k_cache"], c["v_cache"], c["bt"], cu, sl, scale, c["k_scale"],
                               c["v_scale"], max(q_lens), max(lens))
            torch.testing.assert_close(got, dense, rtol=1e-6, atol=1e-6)


def test_sm70_chain_refuses_sparse_attention_by_name():
    from qv.kernels.paged_attention.sparse import SparseAttentionUnavailable, sparse_paged_attention

    q = torch.randn(1, 2, 8)
    with K.backend("sm70"), pytest.raises(SparseAttentionUnavailable, match="sm70"):
        sparse_paged_attention(q, torch.zeros(1, 4, 1, 8), torch.zeros(1, 4, 1, 8),
                               torch.zeros(1, 1, dtype=torch.int32), cu_seqlens([1]).to(DEV),
                               torch.tensor([1], dtype=torch.int32), 1.0,
                               torch.ones(1, 2, 1, dtype=torch.bool), BLOCK_TOKENS)
