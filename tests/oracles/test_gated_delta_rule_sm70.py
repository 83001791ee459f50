"""gated_delta_rule under the "sm70" backend (qv/kernels/gated_delta_rule/cuda_sm70.py) against the fp32
reference: the m8n8k4 chunked prefill (gdn_chunk_m884.cu) on fp16 inputs, and the token-by-token path it
keeps for decode, speculative verification (per-position states) and short queries (Triton's gdn_recurrent,
which has no tl.dot). Fresh random inputs, odd lengths (1, 3, 63, 64, 65, 1000), several sequences with and
without an initial state (those without one start from slots full of NaN), the 27B head counts (16 key / 48
value heads, dk = dv = 128) and the tiny models' ones, fp32 / fp16 / int16 state pools whose other slots must
stay untouched, inputs with the model's strides, and every tensor the op allocates poisoned with NaN.

On CPU: the BUILDS instantiations compile for compute_70 with CUDA 12's NVRTC (ptxas: no spills, an m8n8k4
MMA in every kernel), a NumPy model of the fragment mapping checks the kernel's indexing against the PTX ISA's
fragment tables, and the fallback (no CUDA kernels) runs through the Triton interpreter."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from kernel_cases import BOUND, DEV, K, cu_seqlens, nan_empty, randn, run_reference
from qv.kernels.gated_delta_rule import cuda_sm70
from qv.kernels.gated_delta_rule.reference import load_state
from util import assert_close

F16 = torch.float16
STATE_BOUND = 1e-2  # fp16 activations; the state stays fp32 in the kernels (int16 pools: their grid, as the reference)


def _cuda_kernels_can_run() -> bool:
    from qv.kernels.cuda_build import cupy_or_none

    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 7 and cupy_or_none() is not None


needs_m884 = pytest.mark.skipif(not _cuda_kernels_can_run(), reason="needs a CUDA GPU (sm_70+) and CuPy")


def _inputs(hk, rep, dk, dv, lens, strided, dtype=F16):
    """q, k, v, a, b: contiguous, or column slices of one wide tensor as the model passes them."""
    hv, t = hk * rep, sum(lens)
    if not strided:
        return (randn(t, hk, dk, dtype=dtype), randn(t, hk, dk, dtype=dtype), randn(t, hv, dv, dtype=dtype),
                randn(t, hv, dtype=dtype), randn(t, hv, dtype=dtype))
    kd = hk * dk
    mixed = randn(t, 2 * kd + hv * dv + 5, dtype=dtype)
    ab = randn(t, 2 * hv + 3, dtype=dtype)
    return (mixed[:, :kd].view(t, hk, dk), mixed[:, kd:2 * kd].view(t, hk, dk),
            mixed[:, 2 * kd:2 * kd + hv * dv].view(t, hv, dv), ab[:, :hv], ab[:, hv + 1:2 * hv + 1])


def _pool(n_slots, hv, dk, dv, state_dtype):
    h = randn(n_slots, hv, dk, dv, scale=0.1)
    if state_dtype != torch.int16:
        return h.to(state_dtype), None
    scale = h.abs().amax(2).clamp_min(1e-30) / 32767.0
    return torch.round(h / scale[:, :, None, :]).to(torch.int16), scale


def _case(monkeypatch, state_dtype, hk, rep, dk, dv, lens, init, max_q="auto", inter=False, strided=False,
          path="cuda"):
    """The op under "sm70" (everything it allocates poisoned) and the reference on the same inputs; `path`: which
    of cuda_sm70's paths must have run ("cuda": the m884 kernels, "step": the token-by-token kernel)."""
    hv, n = hk * rep, len(lens)
    q, k, v, a, b = _inputs(hk, rep, dk, dv, lens, strided)
    A_log, dt_bias = randn(hv, scale=0.5), randn(hv, scale=0.5)
    n_slots = n + 3
    slots = torch.randperm(n_slots, device=DEV)[:n]
    pool, scale = _pool(n_slots, hv, dk, dv, state_dtype)
    fresh = slots[~torch.tensor(init, device=DEV)]  # slots of sequences without a state: poisoned
    if state_dtype == torch.int16:
        pool[fresh], scale[fresh] = 32767, float("nan")
    else:
        pool[fresh] = float("nan")
    states, scales = [pool.clone(), pool.clone()], [None, None] if scale is None else [scale.clone(), scale.clone()]
    inters = [None, None]
    if inter:
        inters = [torch.full((n, max(lens), hv, dk, dv), float("nan"), device=DEV) for _ in range(2)]
    ran = []
    real = cuda_sm70.gdn_chunked_cuda
    monkeypatch.setattr(cuda_sm70, "gdn_chunked_cuda", lambda *args: ran.append(real(*args)) or ran[-1])
    args = (q, k, v, a, b, A_log, dt_bias)
    mq = max(lens) if max_q == "auto" else max_q
    meta = (cu_seqlens(lens), slots, torch.tensor(init, device=DEV))
    with K.backend("sm70"), nan_empty():
        out = K.gated_delta_rule(*args, states[0], *meta, state_scale=scales[0], intermediate_states=inters[0],
                                 max_query_len=mq)
    ref = run_reference(K.gated_delta_rule, *args, states[1], *meta, state_scale=scales[1],
                        intermediate_states=inters[1], max_query_len=mq)
    if path == "cuda":
        assert len(ran) == 1 and ran[0] is not None, "the m8n8k4 kernels did not run"
    else:
        assert all(r is None for r in ran), "a token-by-token case went to the chunked kernels"
    cu = [0, *np.cumsum(lens).tolist()]
    for i in range(n):  # sequence by sequence: a short one must not hide in a long one's error
        if lens[i]:
            rows = slice(cu[i], cu[i + 1])
            assert_close(f"o of sequence {i} ({lens[i]} tokens)", out[rows], ref[rows], BOUND[F16])
        s = int(slots[i])
        assert_close(f"state[{s}]", load_state(states[0], scales[0], s), load_state(states[1], scales[1], s),
                     STATE_BOUND)
        if inter and lens[i]:
            assert_close(f"intermediate[{i}]", inters[0][i, :lens[i]], inters[1][i, :lens[i]], STATE_BOUND)
    others = sorted(set(range(n_slots)) - set(slots.tolist()))
    assert torch.equal(states[0][others], pool[others]), "a slot outside the batch was written"
    if scale is not None:
        assert torch.equal(scales[0][others], scale[others]), "a scale outside the batch was written"


LENS = [1, 3, 63, 64, 65, 1000]


@pytest.mark.gpu
@needs_m884
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.float16, torch.int16])
def test_chunked_27b_heads_gpu(monkeypatch, state_dtype):
    """The 27B GDN heads over the odd lengths, every other sequence with an initial state; max_query_len known
    and unknown (both chunked)."""
    init = [i % 2 == 0 for i in range(len(LENS))]
    _case(monkeypatch, state_dtype, 16, 3, 128, 128, LENS, init)
    _case(monkeypatch, state_dtype, 16, 3, 128, 128, LENS[::-1], init, max_q=None, strided=True)


@pytest.mark.gpu
@needs_m884
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.int16])
@pytest.mark.parametrize("hk,rep,dk,dv", [(1, 3, 32, 16), (2, 2, 8, 20), (1, 2, 40, 24), (2, 1, 64, 72),
                                          (4, 3, 128, 128)])
def test_chunked_small_heads_gpu(monkeypatch, state_dtype, hk, rep, dk, dv):
    """The tiny models' geometries (gqa3 dk 32 / dv 16, mixed dk 8 / dv 20), dk 40 (padded to 64), dv 72
    (three 32-column programs, the last partly past dv); empty and single-token sequences among chunked
    ones, the first one empty."""
    lens = [0, 65, 1, 130, 17, 64]
    init = [True, True, False, False, True, False]
    _case(monkeypatch, state_dtype, hk, rep, dk, dv, lens, init, strided=True)


@pytest.mark.gpu
@needs_m884
def test_chunked_single_sequences_gpu(monkeypatch):
    """One sequence a call: with and without a state, one chunk exactly and 1000 tokens."""
    for lens, init in (([1000], [True]), ([1000], [False]), ([64], [True]), ([65], [False])):
        _case(monkeypatch, torch.float32, 16, 3, 128, 128, lens, init, max_q=None)


@pytest.mark.gpu
@needs_m884
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.int16])
def test_chunked_empty_sequences_gpu(monkeypatch, state_dtype):
    """No token at all (max_query_len unknown: the chunked path): a slot with a state keeps it (int16: the same
    values on a recomputed grid), one without is zeroed."""
    _case(monkeypatch, state_dtype, 2, 3, 128, 128, [0, 0, 0], [True, False, True], max_q=None)


@pytest.mark.gpu
@needs_m884
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.float16, torch.int16])
def test_token_by_token_27b_heads_gpu(monkeypatch, state_dtype):
    """Decode (batch 32 and 1), speculative verification with per-position states (k = 3) and short queries
    (up to RECURRENT_MAX_LEN) at the 27B heads: the Triton step kernel, never the chunked kernels."""
    kw = dict(monkeypatch=monkeypatch, state_dtype=state_dtype, hk=16, rep=3, dk=128, dv=128, path="step")
    _case(lens=[1] * 32, init=[True] * 31 + [False], **kw)
    _case(lens=[1, 0, 1], init=[False, True, True], max_q=1, **kw)
    _case(lens=[4, 4, 2, 4], init=[True, False, True, True], inter=True, **kw)
    _case(lens=[3, 16, 1], init=[True, False, True], strided=True, **kw)


# ---- CPU: the build for sm_70, the fragment mapping, the fallback ----

# the sm_70 builds of BUILDS (NVRTC 12, ptxas, spills, MMA counts): tests/test_kernels_aot.py


def _ptx_a(lane, i, row_major):  # (row, column) in the quad-pair's 8x4 A of element a_i
    hi = 4 if lane >= 16 else 0
    return (lane % 4 + hi, i) if row_major else (i % 4 + hi, lane % 4)


def _ptx_b(lane, i, col_major):  # (row, column) in the 4x8 B of element b_i
    hi = 4 if lane >= 16 else 0
    return (i, lane % 4 + hi) if col_major else (lane % 4, i % 4 + hi)


def _ptx_c(lane, i):  # (row, column) in the 8x8 C/D of element c_i
    hi = 4 if lane >= 16 else 0
    return (lane % 2) + (i & 2) + hi, (i & 1) + (lane & 2) + (i & 4)


def _kernel_geometry(lane):
    """gdn_chunk_m884.cu's Frag: the quad-pair's 8x8 block in the 16x16 tile, the lane's index t in it."""
    p = (lane >> 2) & 3
    return 8 * (p & 1), 8 * (p >> 1), (lane & 3) + 4 * ((lane >> 4) & 1)


def _kernel_fragments(A, B, lane, k0, a_row, b_col):
    """The four A and four B values warp_mma loads for a lane (its addresses, for the tile at m0 = n0 = 0)."""
    row8, col8, t = _kernel_geometry(lane)
    fa = [A[row8 + t, k0 + i] if a_row else A[row8 + 4 * (t >> 2) + i, k0 + (t & 3)] for i in range(4)]
    fb = [B[k0 + i, col8 + t] if b_col else B[k0 + (t & 3), col8 + 4 * (t >> 2) + i] for i in range(4)]
    return fa, fb


@pytest.mark.parametrize("a_row", [True, False])
@pytest.mark.parametrize("b_col", [True, False])
def test_m884_fragment_mapping(a_row, b_col):
    """A 16x16x16 product through the kernel's loads, executed as the PTX ISA defines mma.m8n8k4 (each
    quad-pair assembles its A, B from its lanes' registers), lands each sum where Frag::row/col say."""
    rng = np.random.default_rng(0)
    A, B = rng.integers(-8, 8, (16, 16)).astype(np.float64), rng.integers(-8, 8, (16, 16)).astype(np.float64)
    acc = np.zeros((32, 8))
    for k0 in range(0, 16, 4):
        frags = [_kernel_fragments(A, B, lane, k0, a_row, b_col) for lane in range(32)]
        for p in range(4):
            lanes = [*range(4 * p, 4 * p + 4), *range(4 * p + 16, 4 * p + 20)]
            a8, b8 = np.full((8, 4), np.nan), np.full((4, 8), np.nan)
            for lane in lanes:
                for i in range(4):
                    a8[_ptx_a(lane, i, a_row)] = frags[lane][0][i]
                    b8[_ptx_b(lane, i, b_col)] = frags[lane][1][i]
            assert not np.isnan(a8).any() and not np.isnan(b8).any()
            d8 = a8 @ b8
            for lane in lanes:
                for i in range(8):
                    acc[lane, i] += d8[_ptx_c(lane, i)]
    full, seen = A @ B, np.zeros((16, 16), dtype=int)
    for lane in range(32):
        row8, col8, t = _kernel_geometry(lane)
        for i in range(8):
            r, c = row8 + (t & 1) + (i & 2) + 4 * (t >> 2), col8 + (i & 1) + (t & 2) + (i & 4)  # Frag::row/col
            assert acc[lane, i] == full[r, c], (lane, i)
            seen[r, c] += 1
    assert (seen == 1).all()


def test_sm70_falls_back_to_the_step_kernel(monkeypatch):
    """Where the CUDA kernels cannot run (here: CPU tensors, the Triton interpreter), a prefill under "sm70" runs
    the token-by-token kernel, never the tl.dot chunked kernels, and matches the reference."""
    from qv.kernels.gated_delta_rule import triton_chunk, triton_prep

    if DEV.type == "cuda":
        pytest.skip("the CPU fallback case")

    def forbidden(*args, **kwargs):
        raise AssertionError("the sm70 backend ran a tl.dot kernel")

    for module, name in ((triton_chunk, "gdn_chunked"), (triton_prep, "chunk_prep"), (triton_prep, "chunk_prep_split")):
        monkeypatch.setattr(module, name, forbidden)
    meta = cu_seqlens([3]), torch.zeros(1, dtype=torch.int64), torch.ones(1, dtype=torch.bool)
    assert cuda_sm70.gdn_chunked_cuda(*_inputs(1, 2, 16, 16, [3], False), randn(2), randn(2), randn(1, 2, 16, 16),
                                      *meta, 0.25, None) is None
    for state_dtype in (torch.float32, torch.int16):
        _case(monkeypatch, state_dtype, 1, 2, 16, 24, [20, 1, 0], [True, False, True], max_q=None, path="step")


def test_step_kernel_has_no_tl_dot():
    """The sm70 backend keeps Triton's token-by-token kernel: CUDA-core sums only, no tl.dot."""
    src = (Path(cuda_sm70.__file__).parent / "triton_recurrent.py").read_text()
    assert "tl.dot" not in src
    assert not re.search(r"triton_(chunk|prep)", Path(cuda_sm70.__file__).read_text().split('"""', 2)[2])
