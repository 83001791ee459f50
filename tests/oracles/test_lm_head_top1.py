"""lm_head_top1 against the exact fp32 argmax (reference.py): int4 and int8 ranking copies and the dense path,
odd row counts and a vocabulary off the tile grid, planted exact ties (the lowest index wins), a planted
near-tie that the compressed ranking gets wrong and the exact re-scoring fixes, pass 1's candidates against
the dequantized copy, the copy's packing, and (GPU) the 27B shapes, their shortlist miss rate and CUDA-graph
capture with replays on new inputs. Outputs and intermediates are poisoned (run_triton)."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import DEV, K, capture_graph, nan_empty, randn, run_reference, run_triton
from qv.kernels.lm_head_top1 import build_top1_ranking, configs
from qv.kernels.lm_head_top1 import triton as top1_triton

SMALL_V, SMALL_H = 333, 40  # the vocabulary is off every tile size; H off the int4 word (8 codes)


def _weight(v, h, dtype=torch.bfloat16):
    return randn(v, h, dtype=dtype, scale=0.05)


def _shortlist_indices(x, ranking):
    with K.backend("triton"):
        ci, pos = top1_triton.shortlist(x, ranking)
    return ci.gather(1, pos).long()


def _check(x, w, ranking, max_misses=0):
    """The op's contract: the exact argmax wherever it is on the shortlist (always, without a ranking copy),
    else the exact best of the shortlist; at most `max_misses` rows of the call off the shortlist."""
    ours = run_triton(K.lm_head_top1, x, w, ranking)
    ref = run_reference(K.lm_head_top1, x, w, ranking)
    assert ours.dtype == torch.int64 and ours.shape == (x.shape[0],)
    if ranking is None:
        assert torch.equal(ours, ref), f"rows differ: {(ours != ref).nonzero().flatten().tolist()}"
        return ours
    short = _shortlist_indices(x, ranking)
    hit = (short == ref[:, None]).any(1)
    assert torch.equal(ours[hit], ref[hit]), f"rows differ: {((ours != ref) & hit).nonzero().flatten().tolist()}"
    exact = torch.einsum("rh,rkh->rk", x.double(), w[short].double())
    best_on_list = torch.where(exact == exact.max(1, keepdim=True).values, short, w.shape[0]).min(1).values
    assert torch.equal(ours[~hit], best_on_list[~hit])
    assert int((~hit).sum()) <= max_misses, f"{int((~hit).sum())} of {x.shape[0]} rows missed the shortlist"
    return ours


@pytest.mark.parametrize("bits", [4, 8, None])
@pytest.mark.parametrize("rows", [1, 3, 4, 16, 33])
def test_equals_reference(bits, rows):
    w = _weight(SMALL_V, SMALL_H)
    ranking = None if bits is None else build_top1_ranking(w, bits)
    # int4 on random rows: a miss is about 1e-3 a row at this size; int8 and exact misses are not expected
    _check(randn(rows, SMALL_H, dtype=torch.bfloat16), w, ranking, max_misses=1 if bits == 4 else 0)


@pytest.mark.parametrize("dtype,h", [(torch.float16, 37), (torch.float32, 64)])
def test_other_dtypes_and_widths(dtype, h):
    w = _weight(SMALL_V, h, dtype)
    for bits in (4, 8):
        _check(randn(5, h, dtype=dtype), w, build_top1_ranking(w, bits), max_misses=1 if bits == 4 else 0)


def test_shapes_on_the_tile_grid():
    """R, V and the packed words on the interpreter's tiles (the kernel's unmasked loop)."""
    w = _weight(320, 64)
    for bits in (4, 8):
        _check(randn(4, 64, dtype=torch.bfloat16), w, build_top1_ranking(w, bits), max_misses=1 if bits == 4 else 0)


def test_strided_rows():
    w = _weight(SMALL_V, SMALL_H)
    x = randn(6, 2, SMALL_H, dtype=torch.bfloat16)[:, 1]  # rows 2H apart
    _check(x, w, build_top1_ranking(w), max_misses=1)


@pytest.mark.parametrize("bits", [4, 8, None])
def test_planted_ties_go_to_the_lowest_index(bits):
    """The same best row at several indices, within one tile and across tiles: the lowest one wins."""
    w = _weight(SMALL_V, SMALL_H)
    x = randn(4, SMALL_H, dtype=torch.bfloat16)
    plants = ([40, 41, 300], [7, 290, 291], [100, 5, 332], [0, 1, 2])  # per row; unsorted on purpose
    for r, where in enumerate(plants):
        w[where] = (x[r].float() * 0.5).to(w.dtype)  # aligned with x: far above the random rows
    ranking = None if bits is None else build_top1_ranking(w, bits)
    ours = _check(x, w, ranking)
    assert ours.tolist() == [min(p) for p in plants]


def _plant_near_tie(w, x, a, b, tries=400):
    """Rows b and a (a random near copy of b) planted in w with exact x.a > x.b but int4-ranked x.a < x.b,
    both well clear of fp32 rounding; returns the ranking copy of the planted w."""
    base = torch.randn(w.shape[1], device=DEV) * 0.05 + x.float() * 0.02
    w[b] = base.to(w.dtype)
    for _ in range(tries):
        w[a] = (base + torch.randn_like(base) * 0.004).to(w.dtype)
        ranking = build_top1_ranking(w, 4)
        exact = w[[a, b]].double() @ x.double()
        approx = ranking.dequantize(slice(None))[[a, b]].double() @ x.double()
        tol = 1e-3 * exact[1].abs()
        if exact[0] > exact[1] + tol and approx[0] < approx[1] - tol:
            return ranking
    raise AssertionError("no near-tie pair found")


def test_near_tie_needs_the_exact_rescoring():
    """Row a is the exact best but the compressed copy ranks b above it: pass 1 alone would answer b (checked),
    the op answers a. Both sit far above the other rows, so both reach the shortlist."""
    x = randn(1, SMALL_H, dtype=torch.bfloat16)
    w = _weight(SMALL_V, SMALL_H) * 0.1
    a, b = 250, 17
    ranking = _plant_near_tie(w, x[0], a, b)
    with K.backend("triton"), nan_empty():
        cv, ci = top1_triton.tile_candidates(x, ranking)
    assert int(ci[0, cv[0].argmax()]) == b, "the compressed ranking was meant to prefer b"
    assert _check(x, w, ranking).tolist() == [a]


@pytest.mark.parametrize("bits", [4, 8])
def test_tile_candidates_match_the_dequantized_copy(bits):
    """Pass 1's values are the dequantized copy's scores of the indices it names, each tile's best first. Its
    fp32 sums carry each code's power-of-two offset (up to 128 for int4), so they hold to ~1e-4 of the scale."""
    w = _weight(SMALL_V, SMALL_H)
    x = randn(7, SMALL_H, dtype=torch.bfloat16)
    ranking = build_top1_ranking(w, bits)
    with K.backend("triton"), nan_empty():
        cv, ci = top1_triton.tile_candidates(x, ranking)
    scores = x.double() @ ranking.dequantize().double().T  # [R, V]
    tol = 2e-4 * scores.abs().max()
    assert (ci >= 0).all() and (ci < SMALL_V).all()
    assert (scores.gather(1, ci.long()) - cv.double()).abs().max() < tol
    block_v = configs.rank_config(DEV, x.shape[0], bits)["BLOCK_V"]
    pad = -SMALL_V % block_v
    tiles = torch.nn.functional.pad(scores, (0, pad), value=float("-inf")).view(x.shape[0], -1, block_v)
    best = tiles.topk(configs.CAND, dim=2).values.flatten(1)  # per tile, best first
    assert (best - cv.double()).abs().max() < tol


@pytest.mark.parametrize("bits", [4, 8])
def test_ranking_copy_packing(bits):
    """Codes in range, every code slot unpacked to its hidden index, and the error of a symmetric row scale."""
    w = _weight(SMALL_V, 37, torch.float32)
    ranking = build_top1_ranking(w, bits)
    per_word, qmax = 32 // bits, (1 << (bits - 1)) - 1
    assert ranking.codes.shape == (SMALL_V, -(-37 // per_word)) and ranking.codes.dtype == torch.int32
    c, deq = ranking.unpack(), ranking.dequantize()
    step = ranking.scales[:, None] * ranking.col_scale[None, :]
    assert c.abs().max() <= qmax and torch.allclose(deq, c.float() * step)
    kept = w.abs() <= qmax * step  # not clipped: within half a step
    assert ((deq - w).abs() <= step * 0.5001)[kept].all()
    bound = 0.12 if bits == 4 else 0.008
    assert ((deq - w).norm() / w.norm()).item() < bound
    loud = w.clone()
    loud[:, [3, 17, 30]] *= 6  # large channels: the equalized copy keeps the plain copy's error (0.27 without)
    deq = build_top1_ranking(loud, bits).dequantize()
    assert ((deq - loud).norm() / loud.norm()).item() < bound
    spike = w.clone()
    spike[3, 11] = 50.0  # a lone row maximum lands on its own code: packing keeps slot order
    assert build_top1_ranking(spike, bits).dequantize()[3].abs().argmax() == 11


def test_bad_inputs_name_the_cause():
    w = _weight(SMALL_V, SMALL_H)
    ranking = build_top1_ranking(w)
    with pytest.raises(ValueError, match="x \\[R, H\\]"):
        K.lm_head_top1(randn(2, SMALL_H + 1), w, ranking)
    with pytest.raises(ValueError, match="unit inner stride"):
        K.lm_head_top1(randn(2, SMALL_V), w.T, None)
    with pytest.raises(ValueError, match="ranking copy"):
        K.lm_head_top1(randn(2, SMALL_H), w[:100], ranking)
    with pytest.raises(ValueError, match="vocabulary of 0 rows"):
        K.lm_head_top1(randn(2, SMALL_H), w[:0], None)
    with pytest.raises(ValueError, match="bits"):
        build_top1_ranking(w, 2)
    for empty in (w[:0], w[:, :0]):  # the channel rms of an empty weight crashed in torch's max()
        with pytest.raises(ValueError, match="is empty"):
            build_top1_ranking(empty)
    with pytest.raises(ValueError, match="hidden size 0"):
        K.lm_head_top1(randn(2, 0), w[:, :0], None)


def test_no_rows():
    w = _weight(SMALL_V, SMALL_H)
    assert run_triton(K.lm_head_top1, randn(0, SMALL_H), w, build_top1_ranking(w)).shape == (0,)


# -- GPU, Qwen3.5-27B's lm_head: V 248,320, H 5,120 ----------------------------------------------------------
BIG_V, BIG_H = 248320, 5120


@pytest.fixture(scope="module")
def big():
    torch.manual_seed(1)
    w = (torch.randn(BIG_V, BIG_H, device=DEV) * 0.02).to(torch.bfloat16)
    return w, {bits: build_top1_ranking(w, bits) for bits in (4, 8)}


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [4, 8, None])
@pytest.mark.parametrize("rows", [1, 3, 4, 16, 33, 64])
def test_real_shapes(big, bits, rows):
    """The contract of _check. Random Gaussian rows are a hard case (many near-best tokens): misses stay rare."""
    w, rankings = big
    ranking = None if bits is None else rankings[bits]
    _check(randn(rows, BIG_H, dtype=torch.bfloat16), w, ranking, max_misses=max(1, rows // 16) if bits == 4 else 1)


@pytest.mark.gpu
def test_real_shapes_planted_tie(big):
    w, rankings = big
    x = randn(2, BIG_H, dtype=torch.bfloat16)
    w = w.clone()
    for r, where in enumerate(([200000, 9, 120000], [77, 78, 248319])):
        w[where] = (x[r].float() * 0.01).to(w.dtype)
    assert run_triton(K.lm_head_top1, x, w, build_top1_ranking(w, 4)).tolist() == [9, 77]


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [4, None])
def test_cuda_graph_replay(big, bits):
    """Captured once, replayed on new inputs copied into the captured x: each replay equals the reference."""
    w, rankings = big
    ranking = None if bits is None else rankings[bits]
    x = randn(4, BIG_H, dtype=torch.bfloat16)
    with K.backend("triton"):
        K.lm_head_top1(x, w, ranking)  # compile outside the capture
        graph, out = capture_graph(lambda: K.lm_head_top1(x, w, ranking))
    for _ in range(3):
        new = randn(4, BIG_H, dtype=torch.bfloat16)
        new[1] = w[12345].float() * 40  # a known winner, so a stale replay shows
        x.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        ref = run_reference(K.lm_head_top1, new, w, None)
        assert int(ref[1]) == 12345
        assert torch.equal(out, ref)
