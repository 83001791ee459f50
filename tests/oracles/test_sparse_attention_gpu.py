"""Block-sparse attention at the 27B attention shapes on the GPU (issue 35; run by the lead on an H100):
24 query / 4 KV heads of 256, an int8 paged cache of 16-token pages, selection blocks of 64 keys, random
keys with needles planted at depths 4%..96%, at 32K, 128K and 250K keys.

The needle ladder: for the prompt's last tile (128 rows, the question) and for a decode batch (one row plus
3 speculative rows), each needle is a key made to dominate one (row, query head)'s softmax; its block must be
selected, by the certified and by the original's estimate rule (prefill) and by the top fraction (decode).
Measured and printed for docs/VALIDATION.md: each rule's least captured softmax mass per tile, the share of
blocks kept, and the sparse output's relative RMS error against dense attention (the Triton kernels both).
Asserted: the certified rule's captured mass >= 0.85 per tile, every needle selected, the Triton sparse kernel
within the fp32 reference's bound of the sparse reference, and keep-all equal to the dense kernel.

A second test captures the decode selection (page-table refresh from the step's writes, block stats,
top-fraction selection, the sparse kernel) in a CUDA graph and replays it after new keys are written: equal
to the eager path, and the new block is selected."""

from __future__ import annotations

import pytest
import torch

from qv import kernels as K
from qv.kernels.paged_attention import sparse_reference as S
from qv.kernels.paged_attention.sparse import sparse_paged_attention
from util import rel_err

pytestmark = pytest.mark.gpu

HQ, HKV, D = 24, 4, 256
PAGE, SEL = 16, 64
MASS, TILE = 0.85, 128
NEEDLES = 12
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cuda; cpu only for smoke runs of the logic


def _cache(n: int, gen: torch.Generator):
    """An int8 cache of n random keys/values (written by write_kv in 16K-row chunks), its page tables
    refreshed by the same writes, and its block table (pages shuffled)."""
    dev = DEV
    pages = -(-n // PAGE) + 1
    perm = torch.randperm(pages, generator=gen, device="cpu").to(dev)
    bt = perm[None, : pages - 1].int()
    shape = (pages, PAGE, HKV, D)
    kc, vc = torch.zeros(shape, dtype=torch.int8, device=dev), torch.zeros(shape, dtype=torch.int8, device=dev)
    ks, vs = torch.zeros(shape[:3], device=dev), torch.zeros(shape[:3], device=dev)
    mean, dev_t = S.new_page_stats(pages, HKV, D, dev)
    keys = torch.randn(n, HKV, D, generator=gen, device="cpu").to(dev, torch.bfloat16)
    for lo in range(0, n, 16384):
        hi = min(n, lo + 16384)
        pos = torch.arange(lo, hi, device=dev)
        slots = (bt[0, pos // PAGE].long() * PAGE + pos % PAGE)
        K.write_kv(keys[lo:hi], torch.randn(hi - lo, HKV, D, device=dev, dtype=torch.bfloat16), kc, vc, slots, ks, vs)
        S.update_page_stats(mean, dev_t, kc, ks, slots)
    return dict(kc=kc, vc=vc, ks=ks, vs=vs, bt=bt, mean=mean, dev=dev_t, keys=keys)


def _plant(c, q_rows, n, gen):
    """NEEDLES keys, each pointing at one (row, query head) of q_rows, written at depths 4%..96%; returns
    [(row, head, position)]. The cache and the page tables are refreshed by those writes."""
    dev = q_rows.device
    out = []
    for i in range(NEEDLES):
        depth = 0.04 + 0.92 * i / (NEEDLES - 1)
        pos = int(depth * (n - 4 * SEL))
        row = int(torch.randint(0, q_rows.shape[0], (1,), generator=gen))
        head = int(torch.randint(0, HQ, (1,), generator=gen))
        qv = q_rows[row, head].float()
        key = torch.randn(1, HKV, D, device=dev) * 0.1
        key[0, head // (HQ // HKV)] = qv / qv.norm() * 12 * D ** 0.5  # far above every random key's score
        slot = (c["bt"][0, pos // PAGE].long() * PAGE + pos % PAGE).view(1)
        K.write_kv(key.to(torch.bfloat16), torch.randn(1, HKV, D, device=dev, dtype=torch.bfloat16), c["kc"], c["vc"],
                   slot, c["ks"], c["vs"])
        # refresh the page as its last write did (the page's keys are all the sequence's)
        last = (c["bt"][0, pos // PAGE].long() * PAGE + PAGE - 1).view(1)
        S.update_page_stats(c["mean"], c["dev"], c["kc"], c["ks"], last)
        out.append((row, head, pos))
    return out


@pytest.mark.parametrize("n", [32768, 131072, 250000], ids=["32K", "128K", "250K"])
def test_needle_ladder_at_27b_shapes(n):
    gen = torch.Generator().manual_seed(n)
    c = _cache(n, gen)
    dev = DEV
    scale = D ** -0.5
    nb = S.num_blocks(n, SEL)
    results = {}
    for kind, rows in (("prefill", TILE), ("decode", 4)):
        q = torch.randn(rows, HQ, D, generator=gen, device="cpu").to(dev, torch.bfloat16)
        needles = _plant(c, q, n, gen)
        cu = torch.tensor([0, rows], dtype=torch.int32, device=dev)
        sl = torch.tensor([n], dtype=torch.int32, device=dev)
        bm, bd, nkeys = S.block_stats(c["mean"], c["dev"], c["bt"], sl, PAGE, SEL, nb)
        if kind == "prefill":
            rules = {rule: S.select_prefill(q, cu, sl, bm, bd, nkeys, scale, SEL, mass=MASS, tile=TILE, rule=rule)
                     for rule in ("certified", "estimate")}
        else:
            rules = {"top 0.15": S.select_decode(q, cu, sl, bm, bd, SEL, top=0.15, min_blocks=256)}
        args = (c["kc"], c["vc"], c["bt"], cu, sl, scale)
        dense = K.paged_attention(q, *args, c["ks"], c["vs"], rows, n)
        for rule, keep in rules.items():
            for row, head, pos in needles:
                assert keep[row, head, pos // SEL], f"{n} {kind} {rule}: the needle at {pos} was dropped"
            mass = S.captured_mass(q, c["kc"], c["bt"], cu, sl, scale, keep, SEL, c["ks"])
            tile_mass = mass.view(rows, HKV, HQ // HKV).mean((0, 2))
            visible = ((sl[0] - rows + torch.arange(rows, device=dev)) // SEL + 1).sum() * HQ
            out = sparse_paged_attention(q, *args, keep, SEL, c["ks"], c["vs"], rows, n)
            ref = S.sparse_paged_attention(q, *args, keep, SEL, c["ks"], c["vs"])
            assert rel_err(out.float(), ref.float()) < 1e-2  # the bf16 bound of the kernels
            results[(kind, rule)] = (float(tile_mass.min()), float(keep.sum() / visible), rel_err(out.float(),
                                                                                                  dense.float()))
            if rule == "certified":
                assert float(tile_mass.min()) >= MASS
        keep_all = torch.ones(rows, HQ, nb, dtype=torch.bool, device=dev)  # another kernel than dense's: bf16 bound
        assert rel_err(sparse_paged_attention(q, *args, keep_all, SEL, c["ks"], c["vs"], rows, n).float(),
                       dense.float()) < 1e-2
    for (kind, rule), (mass, kept, err) in results.items():
        print(f"{n} keys, {kind}, {rule}: least tile mass {mass:.3f}, blocks kept {kept:.3f}, "
              f"rel err vs dense {err:.2e}")


def test_decode_selection_and_kernel_replay_in_a_cuda_graph():
    gen = torch.Generator().manual_seed(7)
    n, rows, steps = 40000, 4, 3
    c = _cache(n + rows * steps, gen)
    dev = DEV
    scale = D ** -0.5
    nb = S.num_blocks(n + rows * steps, SEL)
    q = torch.randn(rows, HQ, D, generator=gen, device="cpu").to(dev, torch.bfloat16)
    cu = torch.tensor([0, rows], dtype=torch.int32, device=dev)
    sl = torch.tensor([n], dtype=torch.int32, device=dev)
    slots = torch.zeros(rows, dtype=torch.long, device=dev)
    k_new = torch.zeros(rows, HKV, D, dtype=torch.bfloat16, device=dev)
    v_new = torch.zeros_like(k_new)

    def step():
        K.write_kv(k_new, v_new, c["kc"], c["vc"], slots, c["ks"], c["vs"])
        S.update_page_stats(c["mean"], c["dev"], c["kc"], c["ks"], slots)
        bm, bd, _ = S.block_stats(c["mean"], c["dev"], c["bt"], sl, PAGE, SEL, nb)
        keep = S.select_decode(q, cu, sl, bm, bd, SEL, top=0.15, min_blocks=64, sink=0, recent=0)
        return keep, sparse_paged_attention(q, c["kc"], c["vc"], c["bt"], cu, sl, scale, keep, SEL, c["ks"], c["vs"],
                                            rows, n + rows * steps)

    def inputs(i):
        end = n + rows * (i + 1)
        pos = torch.arange(end - rows, end, device=dev)
        slots.copy_(c["bt"][0, pos // PAGE].long() * PAGE + pos % PAGE)
        sl.fill_(end)
        k_new.copy_((q[:, ::HQ // HKV].float() / q[:, ::HQ // HKV].float().norm(dim=-1, keepdim=True) * 12 * D ** 0.5)
                    .to(torch.bfloat16))  # each row's new key points at its own query: its block must be kept
        v_new.normal_()

    inputs(0)
    step()  # warm-up (Triton compiles) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        keep_g, out_g = step()
    for i in range(1, steps):
        inputs(i)
        graph.replay()
        keep_e, out_e = step()  # the same writes again: the same tables
        assert torch.equal(keep_g, keep_e)
        torch.testing.assert_close(out_g, out_e, rtol=0, atol=0)
        newest = (int(sl[0]) - 1) // SEL
        assert keep_g[:, ::HQ // HKV, newest].all()
