"""gated_delta_rule against the reference recurrence: the token-by-token kernel (decode, short
queries, per-position states for verification) and the chunked kernels (prefill: chunks of 64,
varlen, a ragged last chunk, empty and single-token sequences); GQA ratios 1/2/3, dk != dv,
fp32 / fp16 / int16 state pools whose other slots must stay untouched; the slots of sequences without
an initial state hold NaN, which a kernel must not let through."""

from __future__ import annotations

import functools

import pytest
import torch

from kernel_cases import BOUND, DEV, K, cu_seqlens, randn, run_reference, run_triton
from qv.kernels.gated_delta_rule.configs import SWEEP_CONFIGS
from qv.kernels.gated_delta_rule.reference import load_state
from qv.kernels.gated_delta_rule.triton import gated_delta_rule as gated_delta_rule_triton
from qv.kernels.gated_delta_rule.triton_prep import chunk_prep, chunk_prep_split
from util import assert_close

STATE_BOUND = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def _pool(n_slots, hv, dk, dv, state_dtype):
    h = randn(n_slots, hv, dk, dv, scale=0.1)
    if state_dtype != torch.int16:
        return h.to(state_dtype), None
    scale = h.abs().amax(2).clamp_min(1e-30) / 32767.0
    return torch.round(h / scale[:, :, None, :]).to(torch.int16), scale


def _case(dtype, state_dtype, hk, rep, dk, dv, lens, init, max_q="auto", inter=False, config=None):
    hv, t, n = hk * rep, sum(lens), len(lens)
    q, k = randn(t, hk, dk, dtype=dtype), randn(t, hk, dk, dtype=dtype)
    v, a, b = randn(t, hv, dv, dtype=dtype), randn(t, hv, dtype=dtype), randn(t, hv, dtype=dtype)
    A_log, dt_bias = randn(hv, scale=0.5), randn(hv, scale=0.5)
    n_slots = n + 3
    slots = torch.randperm(n_slots, device=DEV)[:n]
    pool, scale = _pool(n_slots, hv, dk, dv, state_dtype)
    fresh = slots[~torch.tensor(init, device=DEV)]  # slots of sequences without a state: poisoned
    if state_dtype == torch.int16:
        pool[fresh], scale[fresh] = 32767, float("nan")
    else:
        pool[fresh] = float("nan")
    states = [pool.clone(), pool.clone()]
    scales = [None, None] if scale is None else [scale.clone(), scale.clone()]
    inters = [None, None]
    if inter:
        inters = [torch.full((n, max(lens), hv, dk, dv), float("nan"), device=DEV) for _ in range(2)]
    outs = []
    # a config is a gdn_chunked variant (bench/kernels.py --sweep gdn), passed to the triton entry
    ours = K.gated_delta_rule if config is None else functools.partial(gated_delta_rule_triton, config=config)
    for run, fn, st, sc, it in zip((run_triton, run_reference), (ours, K.gated_delta_rule), states, scales, inters):
        outs.append(run(fn, q, k, v, a, b, A_log, dt_bias, st, cu_seqlens(lens), slots, torch.tensor(init, device=DEV),
                        state_scale=sc, intermediate_states=it, max_query_len=max(lens) if max_q == "auto" else max_q))
    if t:
        assert_close("o", outs[0], outs[1], BOUND[dtype])
    bound = max(BOUND[dtype], STATE_BOUND.get(state_dtype, 1e-5))
    for i in range(n):
        s = int(slots[i])
        assert_close(f"state[{s}]", load_state(states[0], scales[0], s), load_state(states[1], scales[1], s), bound)
    others = sorted(set(range(n_slots)) - set(slots.tolist()))
    assert torch.equal(states[0][others], pool[others]), "a slot outside the batch was written"
    if inter:
        for i, n_i in enumerate(lens):
            if n_i:
                assert_close(f"intermediate[{i}]", inters[0][i, :n_i], inters[1][i, :n_i], bound)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.float16, torch.int16])
def test_recurrent_decode(state_dtype):
    _case(torch.float32, state_dtype, 2, 2, 16, 24, [1, 1, 1, 1], [True, False, True, True])


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.int16])
def test_recurrent_decode_with_empty_sequences(state_dtype):
    """max_query_len 1 with sequences of no token in the middle of the batch (with and without a state):
    their state comes back unchanged, or zeroed where they had none."""
    _case(torch.float32, state_dtype, 1, 3, 16, 24, [0, 1, 0, 1, 1], [True, True, False, False, True], max_q=1)


def test_recurrent_short_queries_gqa3():
    _case(torch.float32, torch.float32, 1, 3, 32, 16, [3, 1, 0, 5], [True, False, True, True])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verification_intermediate_states(dtype):
    _case(dtype, torch.float32, 1, 3, 32, 16, [4, 2, 4], [True, False, True], inter=True)


@pytest.mark.parametrize("dtype,state_dtype,hk,rep,dk,dv,lens", [
    (torch.float32, torch.float32, 2, 2, 16, 24, [70, 1, 0, 20]),  # ragged chunks, empty, single token
    (torch.float32, torch.float16, 1, 3, 8, 20, [130, 17]),  # dk 8 (padded to 16), dk < dv
    (torch.bfloat16, torch.float32, 1, 1, 32, 16, [64, 100]),  # exactly one chunk; dk > dv
    (torch.float16, torch.int16, 1, 2, 16, 16, [100, 17]),
])
def test_chunked_prefill(dtype, state_dtype, hk, rep, dk, dv, lens):
    _case(dtype, state_dtype, hk, rep, dk, dv, lens, [i % 2 == 0 for i in range(len(lens))], max_q=None)


@pytest.mark.parametrize("dtype,lens", [
    (torch.float32, [16, 80, 31, 48]),  # last chunk of exactly 16, 17..31, 48 rows (one sub-block empty)
    (torch.float32, [127, 60, 33, 113]),  # 48..63 rows, 33..47, 49
    (torch.bfloat16, [64 + 7, 96, 52]),  # < 16, 32, 48..63
])
def test_chunked_ragged_last_chunk(dtype, lens):
    """Every fill of the last chunk's four 16-row sub-blocks (fresh random inputs each run)."""
    _case(dtype, torch.float32, 1, 2, 16, 16, lens, [i % 2 == 1 for i in range(len(lens))], max_q=None)


@pytest.mark.parametrize("config", SWEEP_CONFIGS, ids=str)
def test_chunked_variants(config):
    """Each swept gdn_chunked config: two chunked sequences (one ragged, one with an initial state), bf16."""
    _case(torch.bfloat16, torch.float32, 1, 2, 16, 24, [150, 70], [True, False], max_q=None, config=config)


@pytest.mark.parametrize("dtype,state_dtype,hk,rep,dk,dv,lens", [
    (torch.float32, torch.float32, 2, 2, 16, 24, [70, 1, 0, 20]),  # varlen, ragged, empty, single token
    (torch.float32, torch.float16, 1, 3, 40, 20, [16, 80, 31, 48]),  # dk 40: k k^T over three slices; GQA 3
    (torch.bfloat16, torch.float32, 1, 2, 16, 16, [127, 60, 33, 113]),  # last chunk fills 48..63, 33..47, 49
    (torch.float16, torch.int16, 1, 2, 16, 16, [64 + 7, 96, 52]),  # < 16, 32, 48..63
])
def test_chunked_split_prep(dtype, state_dtype, hk, rep, dk, dv, lens):
    """The split prep (config prep="split") on the prefill cases: initial states on every other sequence."""
    _case(dtype, state_dtype, hk, rep, dk, dv, lens, [i % 2 == 0 for i in range(len(lens))], max_q=None,
          config=dict(prep="split", solve_bk=16))


def test_too_many_chunks_is_refused_before_any_state_changes():
    """65,536 one-token sequences make more chunks than the output kernel's grid axis holds
    (65,535): a clear error, raised before the state pool is touched."""
    from qv.kernels.gated_delta_rule.triton_chunk import gdn_chunked

    n, hk, hv, d = 65536, 1, 1, 16
    q, k, v = randn(n, hk, d), randn(n, hk, d), randn(n, hv, d)
    a, b = randn(n, hv), randn(n, hv)
    pool = randn(2, hv, d, d)
    before = pool.clone()
    with pytest.raises(ValueError, match="65535"):
        gdn_chunked(q, k, v, a, b, randn(hv), randn(hv), pool, cu_seqlens([1] * n),
                    torch.zeros(n, dtype=torch.int64, device=DEV), torch.ones(n, dtype=torch.bool, device=DEV),
                    d ** -0.5, None)
    assert torch.equal(pool, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_prep_matches_fused(dtype):
    """chunk_prep_split stores what chunk_prep stores (W, U, gc, k's inverse norms per value head),
    padding columns of W and U included: the scan and out kernels read either."""
    hk, rep, dk, dv, lens = 2, 3, 24, 40, [100, 17, 64]
    t, hv = sum(lens), hk * rep
    k, v = randn(t, hk, dk, dtype=dtype), randn(t, hv, dv, dtype=dtype)
    a, b = randn(t, hv, dtype=dtype), randn(t, hv, dtype=dtype)
    A_log, dt_bias = randn(hv, scale=0.5), randn(hv, scale=0.5)
    args = (k, v, a, b, A_log, dt_bias, cu_seqlens(lens), hv)
    fused, split = chunk_prep(*args), chunk_prep_split(*args, solve_bk=16, wy_bv=16)
    for name, x, y in zip(("w", "u", "gc", "rk"), fused, split):
        assert_close(name, y.float(), x.float(), 1e-5 if x.dtype == torch.float32 and name in ("gc", "rk")
                     else BOUND[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("config", SWEEP_CONFIGS, ids=str)
def test_real_shape_variants(config):
    """Each swept gdn_chunked config at the 27B head shapes on the GPU (bf16: tensor-core dots)."""
    _case(torch.bfloat16, torch.float32, 16, 3, 128, 128, [700, 1, 0, 130], [True, True, False, False], config=config)


SMALL_HEAD_CONFIGS = [None, dict(scan_prefetch=False, scan_stages=2), dict(scan_stages=2), dict(scan_prefetch=False),
                      dict(solve_stages=1)]


@pytest.mark.gpu
@pytest.mark.parametrize("config", SMALL_HEAD_CONFIGS, ids=str)
@pytest.mark.parametrize("hk,rep,dk,dv", [(1, 3, 32, 16), (2, 2, 8, 20)])
def test_small_heads_gpu(config, hk, rep, dk, dv):
    """The tiny models' GDN geometries (gqa3, mixed) on the GPU in bf16: tiles narrower than the
    warpgroup MMA's 64 rows, where the compiled kernels differ from the 27B ones. The first sequence is
    empty (the scan's read-ahead once read row -1 for it)."""
    _case(torch.bfloat16, torch.float32, hk, rep, dk, dv, [0, 300, 1, 130], [True, True, False, False], config=config)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,state_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.float32),
                                               (torch.bfloat16, torch.int16), (torch.float16, torch.float16)])
def test_real_shapes(dtype, state_dtype):
    _case(dtype, state_dtype, 16, 3, 128, 128, [700, 1, 0, 130], [True, True, False, False])  # chunked
    _case(dtype, state_dtype, 16, 3, 128, 128, [1] * 32, [True] * 31 + [False])  # decode batch 32
    _case(dtype, state_dtype, 16, 3, 128, 128, [1], [True])  # decode batch 1 (16-column programs)
    _case(dtype, state_dtype, 16, 3, 128, 128, [1, 0, 1], [False, True, True], max_q=1)  # an empty sequence
    _case(dtype, state_dtype, 16, 3, 128, 128, [4] * 4, [True] * 4, inter=True)  # verification, k = 3
