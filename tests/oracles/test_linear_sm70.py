"""The Volta (sm_70) GPTQ linear: the m8n8k4 GEMV and GEMM of qv/kernels/linear/gptq_m884.cu (cuda_sm70.py),
at 8 bits and at 4 (BITS=4: two packed byte rows split into four by nibble masks in registers).

CPU: a NumPy model of mma.m8n8k4's fragment tables runs both kernels' lane arithmetic and byte permutes
(m884_model.py) and must reproduce x W^T with W dequantized to fp16, every output written once; the
fallback path is checked under the sm70 backend; the sm70 chain must pick cuda_sm70.linear.
GPU (on the H200 the m8n8k4 MMA is emulated): the kernels are called directly and must report that they
ran, on NaN-poisoned outputs, for M 1..16 (GEMV) and 1, 7, 17, 33, 200 (GEMM) at odd and 27B shapes,
against the fp32 reference row by row within BOUND_SM70 (docs/VALIDATION.md: weights and outputs each
rounded once to fp16, about 4e-4 RMS relative in all; the bound leaves 5x)."""

from __future__ import annotations

import importlib.util
import re

import numpy as np
import pytest
import torch

import m884_model as model
from kernel_cases import BOUND, DEV, K, capture_graph, nan_empty, randn, run_reference
from test_linear import gptq_weight
from test_linear_int4 import int4_weight
from util import assert_close

BOUND_SM70 = 2e-3
needs_cupy = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("cupy") is None,
                                reason="needs a GPU and CuPy (the gpu extra)")


# --- CPU: the model of the instruction and of the kernels ----------------------------------------------

def test_mma_model_layout_is_a_bijection():
    """Each quad pair's 8 lanes x 8 accumulators cover its 8 x 8 block once, and A / B fragments every row
    and column: the PTX tables the model (and the kernels) rely on are consistent."""
    for q in range(4):
        lanes = np.flatnonzero(model.QP == q)
        assert sorted(model.THREAD[lanes]) == list(range(8))
        cells = {(r, c) for lane in lanes for r, c in zip(model.D_ROW[lane], model.D_COL[lane])}
        assert len(cells) == 64
    rng = np.random.default_rng(0)
    a, b, c = rng.standard_normal((32, 4)), rng.standard_normal((32, 4)), rng.standard_normal((32, 8))
    d = model.mma_m8n8k4(a, b, c)
    for lane in range(32):  # element i of lane L is sum_k A[row][k] B[k][col] + C with the row's / column's lanes
        for i in range(8):
            row_lane = np.flatnonzero((model.QP == model.QP[lane]) & (model.THREAD == model.D_ROW[lane, i]))[0]
            col_lane = np.flatnonzero((model.QP == model.QP[lane]) & (model.THREAD == model.D_COL[lane, i]))[0]
            assert np.isclose(d[lane, i], a[row_lane] @ b[col_lane] + c[lane, i])


def _model_case(m, n, k, group, zeros, seed, bits=8):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float16)
    codes = rng.integers(0, 256, (k * bits // 8, n), dtype=np.uint8)  # at 4 bits: two codes a byte
    scales = (rng.random((k // group, n)) * 0.02 + 1e-3).astype(np.float16)
    # 2^bits: a v1 checkpoint's all-ones zero read back + 1
    z = rng.integers(0, (1 << bits) + 1, (k // group, n)).astype(np.float16) if zeros else None
    ref = x.astype(np.float64) @ model.dequantized(codes, scales, z, group, bits).astype(np.float64)
    return x, codes, scales, z, ref


@pytest.mark.parametrize("m,n,k,group,zeros,k_split", [
    (3, 264, 64, 16, True, None),   # a second column tile with one lane's columns; one group a warp
    (13, 40, 96, 32, False, 64),    # two 8-row tiles of x, rows past M; split-K at a group boundary
    (8, 512, 256, 16, True, None),  # every warp several groups
    (2, 16, 1024, 1024, True, 512),  # one group over K: chunks of 128 rows over the warps and splits
])
@pytest.mark.parametrize("bits", [8, 4])
def test_gemv_model(m, n, k, group, zeros, k_split, bits):
    x, codes, scales, z, ref = _model_case(m, n, k, group, zeros, seed=m, bits=bits)
    y = model.gemv(x, codes, scales, z, group, k_split, bits)
    np.testing.assert_allclose(y, ref, rtol=1e-9, atol=1e-9 * np.abs(ref).max())


@pytest.mark.parametrize("m,n,k,group,zeros,k_split", [
    (70, 136, 96, 32, True, None),  # two row and two column tiles, both partly past M / N; 3 K steps
    (9, 8, 64, 16, False, 32),      # one narrow tile, split-K, groups of 16 inside a K step
])
@pytest.mark.parametrize("bits", [8, 4])
def test_gemm_model(m, n, k, group, zeros, k_split, bits):
    x, codes, scales, z, ref = _model_case(m, n, k, group, zeros, seed=n, bits=bits)
    y = model.gemm(x, codes, scales, z, group, k_split, bits)
    np.testing.assert_allclose(y, ref, rtol=1e-9, atol=1e-9 * np.abs(ref).max())


def test_gemm_tile_order_visits_every_tile_once():
    for tiles_m, tiles_n in [(1, 1), (3, 5), (8, 2), (17, 3), (9, 40)]:
        seen = {model.tile_of(p, tiles_m, tiles_n) for p in range(tiles_m * tiles_n)}
        assert seen == {(a, b) for a in range(tiles_m) for b in range(tiles_n)}


def _banks(rows, k, pitch):
    """The 4-byte banks of 8-byte shared loads/stores at (row, k) in fp16 rows of `pitch` halves."""
    word = (np.asarray(rows) * pitch + k) // 2
    return word, {(w + d) % 32 for w in set(word.tolist()) for d in (0, 1)}


def test_gemm_shared_memory_without_bank_conflicts():
    """Each half warp's 8-byte fragment loads (xs and ws) and weight stores touch distinct addresses in
    distinct banks (same addresses broadcast), at the 36-half row pitch the .cu chose."""
    for half in (range(16), range(16, 32)):
        lanes = np.array(list(half))
        for rows in (8 * (model.QP[lanes] & 1) + model.THREAD[lanes], 8 * (model.QP[lanes] >> 1) + model.THREAD[lanes]):
            word, banks = _banks(rows, 4, model.PITCH)
            assert len(banks) == 2 * len(set(word.tolist()))
        tid = lanes  # the weight loader of warp 0: rq = tid % 8, co = tid / 8; each column c in turn
        for c in range(8):
            word, banks = _banks(8 * (tid // 8) + c, 4 * (tid % 8), model.PITCH)
            assert len(set(word.tolist())) == 16 and len(banks) == 32


# --- CPU: the chain and the fallback --------------------------------------------------------------------

def test_sm70_chain_picks_the_m884_linear(monkeypatch):
    from qv.kernels import registry
    from qv.kernels.linear import cuda_sm70

    with K.backend("sm70"):
        assert registry.impl("linear", torch.device("cuda")) is cuda_sm70.linear
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    with K.backend("auto"):  # auto on a Volta device
        assert registry.impl("linear", torch.device("cuda")) is cuda_sm70.linear
    assert registry.TABLE["linear"]["sm70"] == "linear.cuda_sm70"
    assert {name.split("<")[0] for b in cuda_sm70.BUILDS for name in b.names} == {"gptq_gemv_m884", "gptq_gemm_m884"}


@pytest.mark.parametrize("m,dtype,act_order", [(3, torch.float16, False), (20, torch.float32, True)])
@pytest.mark.parametrize("bits", [8, 4])
def test_sm70_fallback(m, dtype, act_order, bits):
    """Where the kernels do not apply (here: no GPU; on the GPU: act-order, odd groups, ...) the sm70 linear
    dequantizes and multiplies (on CPU, through the Triton interpreter), right, with no tl.dot kernel."""
    from tl_dot_recorder import record_launches

    w = (gptq_weight if bits == 8 else int4_weight)(40, 64, 16, True, act_order, dtype)
    x = randn(m, 64, dtype=dtype)
    with record_launches() as launched, K.backend("sm70"), nan_empty():
        out = K.linear(x, w)
    assert_close("sm70 fallback", out, run_reference(K.linear, x, w), BOUND[dtype])
    if DEV.type == "cpu":
        assert launched.names() == ["gptq_dequant_kernel" if bits == 8 else "int4_dequant_kernel"]
    assert launched.with_dot() == []


def _signature(kernel: str) -> list[tuple[str, type]]:
    """(name, numpy type) of each parameter of a __global__ kernel in gptq_m884.cu."""
    from qv.kernels.cuda_build import KERNEL_DIR
    from qv.kernels.linear.cuda_sm70 import SOURCE

    found = re.search(rf"\b{kernel}\(([^)]*)\)", (KERNEL_DIR / SOURCE).read_text())
    params = []
    for p in " ".join(found.group(1).split()).split(","):
        name = p.split()[-1].lstrip("*")
        params.append((name, np.uint64 if "*" in p else np.int64 if "long long" in p else np.int32))
    return params


@pytest.mark.parametrize("kind,m,n,k,group,split", [
    ("gemv", 5, 264, 2048, 32, True), ("gemv", 16, 40, 96, 16, False),  # (4 "SMs" on the CPU)
    ("gemv", 1, 64, 4096, 4096, True),  # one group over K: split in chunks of 128
    ("gemm", 33, 136, 4096, 64, True), ("gemm", 300, 512, 96, 32, False)])
@pytest.mark.parametrize("bits", [8, 4])
def test_launch_arguments_match_the_kernel(monkeypatch, kind, m, n, k, group, split, bits):
    """The host side on the CPU (kernel_for and launch stubbed): the arguments line up with the kernel's
    parameter list by type and meaning, and the grid's K ranges are whole groups / K steps covering K."""
    from qv.kernels.linear import cuda_sm70

    launched = []
    monkeypatch.setattr(cuda_sm70, "kernel_for", lambda source, name, *a: (name, 152))
    monkeypatch.setattr(cuda_sm70, "launch", lambda kernel, grid, block, args, dev: launched.append(
        (kernel, grid, block, args)))
    w = (gptq_weight if bits == 8 else int4_weight)(n, k, group, True, False, torch.float16)
    x = randn(m, k + 4, dtype=torch.float16)[:, :k]
    bias, out = randn(n, dtype=torch.float16), torch.empty(m, n, dtype=torch.float16)
    assert (cuda_sm70.gemv_m884 if kind == "gemv" else cuda_sm70.gemm_m884)(x, w, bias, out)
    (name, grid, block, args), = launched
    params = _signature(f"gptq_{kind}_m884")
    assert [type(a) for a in args] == [t for _, t in params] and block == (128, 1, 1)
    got = {p: int(a) for (p, _), a in zip(params, args)}
    tensors = dict(x=x, codes=w.qweight, scales=w.scales, zeros=w.zeros, bias=bias, y=out)
    assert all(got[p] == t.data_ptr() for p, t in tensors.items())
    assert (got["M"], got["N"], got["K"], got["group"], got["has_zero"], got["has_bias"]) == (m, n, k, group, 1, 1)
    assert (got["stride_xm"], got["stride_qk"], got["stride_sg"], got["stride_ym"]) == (k + 4, n, n, n)
    step = cuda_sm70.gemv_chunk(group) if kind == "gemv" else cuda_sm70.GEMM_K_STEP
    assert got["k_split"] % step == 0 and (grid[1] - 1) * got["k_split"] < k <= grid[1] * got["k_split"]
    assert (got["part"] != 0) == (got["tickets"] != 0) == (grid[1] > 1) == split
    if kind == "gemv":
        mt = (m + 7) // 8
        assert name == f"gptq_gemv_m884<{mt}, {cuda_sm70.GEMV_MIN_BLOCKS[mt]}{'' if bits == 8 else ', 4'}>"
        assert grid[0] == -(-n // 256)
    else:
        assert name == f"gptq_gemm_m884<{cuda_sm70.GEMM_MIN_BLOCKS}{'' if bits == 8 else ', 4'}>"
        assert grid[0] == -(-m // 64) * -(-n // 128)


# --- GPU: the kernels -----------------------------------------------------------------------------------

def _cuda_case(kind, m, n, k, group, zeros=False, bias=False, strided_x=False, bits=8):
    """The kernel on NaN-poisoned output against the fp32 reference, row by row; it must report that it ran."""
    from qv.kernels.linear import cuda_sm70

    w = (gptq_weight if bits == 8 else int4_weight)(n, k, group, zeros, False, torch.float16)
    if zeros:  # the whole code range, 0 and 2^bits (a stored all-ones v1 zero + 1) included
        w.zeros.copy_(torch.randint(0, (1 << bits) + 1, w.zeros.shape, device=DEV).to(torch.float16))
    x = randn(m, k + 8 if strided_x else k, dtype=torch.float16)[:, :k]
    b = randn(n, dtype=torch.float16) if bias else None
    out = torch.full((m, n), float("nan"), dtype=torch.float16, device=DEV)
    assert cuda_sm70.applies(x, w, b)
    run = cuda_sm70.gemv_m884 if kind == "gemv" else cuda_sm70.gemm_m884
    assert run(x, w, b, out), f"the sm70 {kind} did not run"
    ref = run_reference(K.linear, x, w, b)
    for r in range(m):
        assert_close(f"sm70 {kind} row {r} of {m}x{n}x{k}", out[r], ref[r], BOUND_SM70)
    return x, w, b, out


@pytest.mark.gpu
@needs_cupy
@pytest.mark.parametrize("m", list(range(1, 17)))
def test_gemv_sm70_gpu(m):
    _cuda_case("gemv", m, 264, 96, 32, zeros=m % 2 == 1, bias=m % 3 == 0)  # a partial column tile
    _cuda_case("gemv", m, 8, 16, 16, bias=True)  # one lane's columns, one group
    _cuda_case("gemv", m, 1040, 384, 128, zeros=True, strided_x=True)
    _cuda_case("gemv", m, 5120, 17408, 128, zeros=m == 5)  # down_proj: split-K, the ticketed sum
    if m in (1, 4, 16):
        _cuda_case("gemv", m, 34816, 5120, 128)  # gate+up
    if m in (2, 9):
        _cuda_case("gemv", m, 512, 4096, 4096, zeros=True)  # one group over K (`qv quantize --group-size -1`)


@pytest.mark.gpu
@needs_cupy
@pytest.mark.parametrize("m", [1, 7, 17, 33, 200])
def test_gemm_sm70_gpu(m):
    _cuda_case("gemm", m, 136, 96, 32, zeros=True, bias=True)  # tiles partly past M and N
    _cuda_case("gemm", m, 8, 48, 16, strided_x=True)
    _cuda_case("gemm", m, 5120, 17408, 128, zeros=m == 33)  # few tiles: split-K
    _cuda_case("gemm", m, 34816, 5120, 128, bias=m == 200)
    _cuda_case("gemm", m, 12288, 5120, 128)  # the fused q/k/v-sized projection
    _cuda_case("gemm", m, 256, 4096, 4096, zeros=True)  # one group over K


@pytest.mark.gpu
@needs_cupy
@pytest.mark.parametrize("kind,m,n,k", [("gemv", 5, 2064, 4096), ("gemm", 40, 1024, 4096)])
def test_sm70_split_deterministic_and_graph_gpu(kind, m, n, k):
    """Split-K (the last block per tile sums the partials in split order): the same bits on a rerun and
    under CUDA-graph replay, and the tickets left at zero."""
    from qv.kernels.linear import cuda_sm70, triton_gemv

    x, w, b, out = _cuda_case(kind, m, n, k, 128, zeros=True, bias=True)
    run = cuda_sm70.gemv_m884 if kind == "gemv" else cuda_sm70.gemm_m884
    again = torch.empty_like(out)
    assert run(x, w, b, again) and torch.equal(again, out)
    graph_out = torch.empty_like(out)
    graph, ran = capture_graph(lambda: run(x, w, b, graph_out))
    assert ran
    for _ in range(2):
        graph_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(graph_out, out)
    assert all(int(t.abs().sum()) == 0 for t in triton_gemv._TICKETS.values())


@pytest.mark.gpu
@needs_cupy
@pytest.mark.parametrize("m", [1, 5, 16, 17, 200])
def test_linear_op_sm70_gpu(monkeypatch, m):
    """The public op under the sm70 backend runs the kernels (the fallback is made to fail) at 27B shapes,
    on poisoned allocations, and dense weights go to cuBLAS."""
    from qv.kernels.linear import cuda_sm70

    def no_fallback(*args):
        raise AssertionError("the sm70 linear fell back to dequantize + cuBLAS")

    monkeypatch.setattr(cuda_sm70, "dequant_matmul", no_fallback)
    w = gptq_weight(5120, 6144, 128, True, False, torch.float16)
    x = randn(m, 6144, dtype=torch.float16)
    with K.backend("sm70"), nan_empty():
        out = K.linear(x.view(1, m, 6144), w)
    assert out.shape == (1, m, 5120)
    assert_close("sm70 linear", out[0], run_reference(K.linear, x, w), BOUND_SM70)
    dense = randn(300, 6144, dtype=torch.float16)
    with K.backend("sm70"):
        assert_close("sm70 dense", K.linear(x, dense), run_reference(K.linear, x, dense), BOUND[torch.float16])


@pytest.mark.gpu
@needs_cupy
@pytest.mark.parametrize("what", ["bf16", "act_order", "group_8", "n_27"])
def test_sm70_fallback_gpu(what):
    """Where a kernel does not apply, `applies` says so and the op's fallback is right (no tl.dot)."""
    from qv.kernels.linear import cuda_sm70
    from tl_dot_recorder import record_launches

    dtype = torch.bfloat16 if what == "bf16" else torch.float16
    n, group = (27, 16) if what == "n_27" else (64, 8 if what == "group_8" else 16)
    w = gptq_weight(n, 64, group, True, what == "act_order", dtype)
    for m in (3, 40):
        x = randn(m, 64, dtype=dtype)
        assert not cuda_sm70.applies(x, w, None)
        with record_launches() as launched, K.backend("sm70"), nan_empty():
            out = K.linear(x, w)
        assert_close(f"sm70 fallback {what}", out, run_reference(K.linear, x, w), BOUND[dtype])
        assert launched.with_dot() == []


@pytest.mark.gpu
@needs_cupy
@pytest.mark.parametrize("m", [1, 2, 7, 8, 9, 13, 16])
def test_gemv_sm70_int4_gpu(m):
    torch.manual_seed(m)
    _cuda_case("gemv", m, 264, 96, 32, zeros=m % 2 == 1, bias=m % 3 == 0, bits=4)
    _cuda_case("gemv", m, 8, 16, 16, bias=True, bits=4)
    _cuda_case("gemv", m, 1040, 384, 128, zeros=True, strided_x=True, bits=4)
    _cuda_case("gemv", m, 5120, 17408, 128, zeros=m == 7, bits=4)  # split-K, the ticketed sum
    _cuda_case("gemv", m, 512, 4096, 4096, zeros=True, bits=4)  # one group over K


@pytest.mark.gpu
@needs_cupy
@pytest.mark.parametrize("m", [1, 7, 17, 33, 200])
def test_gemm_sm70_int4_gpu(m):
    torch.manual_seed(m)
    _cuda_case("gemm", m, 136, 96, 32, zeros=True, bias=True, bits=4)
    _cuda_case("gemm", m, 8, 48, 16, strided_x=True, bits=4)
    _cuda_case("gemm", m, 5120, 17408, 128, zeros=m == 33, bits=4)
    _cuda_case("gemm", m, 34816, 5120, 128, bias=m == 200, bits=4)


@pytest.mark.gpu
@needs_cupy
@pytest.mark.parametrize("m", [1, 16, 17, 200])
def test_linear_op_sm70_int4_gpu(monkeypatch, m):
    """The public op under the sm70 backend runs the 4-bit kernels (the fallback is made to fail)."""
    torch.manual_seed(m)
    from qv.kernels.linear import cuda_sm70

    def no_fallback(*args):
        raise AssertionError("the sm70 linear fell back to dequantize + cuBLAS")

    monkeypatch.setattr(cuda_sm70, "dequant_matmul_int4", no_fallback)
    w = int4_weight(5120, 6144, 128, True, False, torch.float16)
    x = randn(m, 6144, dtype=torch.float16)
    with K.backend("sm70"), nan_empty():
        out = K.linear(x.view(1, m, 6144), w)
    assert_close("sm70 int4 linear", out[0], run_reference(K.linear, x, w), BOUND_SM70)
