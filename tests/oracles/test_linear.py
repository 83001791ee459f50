"""linear against the reference: GPTQ-int8 GEMV (M <= 16) and GEMM (larger M), symmetric and
asymmetric zeros, act-order g_idx, bias, M/N/K not multiples of the tiles; dense weights (the
Triton backend hands them to torch.nn.functional.linear). The reference dequantizes the same
int8 codes in fp32, so the bounds are the activation dtype's."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import BOUND, DEV, K, randn, run_reference, run_triton
from qv.kernels.linear import GPTQWeight
from util import assert_close


def gptq_weight(n, k, group, zeros, act_order, dtype):
    g = torch.arange(k, dtype=torch.int32, device=DEV) // group
    if act_order:
        g = g[torch.randperm(k, device=DEV)]
    n_groups = k // group
    return GPTQWeight(
        torch.randint(0, 256, (k, n), dtype=torch.uint8, device=DEV),
        (torch.rand(n_groups, n, device=DEV) * 0.02 + 1e-3).to(dtype),
        torch.randint(96, 160, (n_groups, n), device=DEV).to(dtype) if zeros else None,
        g, group)


def _case(dtype, m, n, k, group, zeros=False, act_order=False, bias=False, config=None):
    from qv.kernels.linear.triton import linear as linear_triton

    w = gptq_weight(n, k, group, zeros, act_order, dtype)
    x = randn(m, k, dtype=dtype)
    b = randn(n, dtype=dtype) if bias else None
    out = run_triton(K.linear, x, w, b) if config is None else run_triton(linear_triton, x, w, b, config=config)
    assert_close("linear", out, run_reference(K.linear, x, w, b), BOUND[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 4, 13])
def test_gptq_gemv(dtype, m):
    _case(dtype, m, 70, 96, 32, zeros=m == 4, bias=m == 13)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 4, 13])
def test_gptq_gemv_tensor_cores_gpu(dtype, m):
    """The tensor-core GEMV (M <= 16; the M = 1 default is the CUDA-core kernel) at odd sizes."""
    cfg = dict(kind="dot")
    _case(dtype, m, 70, 96, 32, zeros=m == 4, bias=m == 13, config=cfg)
    _case(dtype, m, 1000, 5120, 128, zeros=m != 4, config=cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gptq_gemv_cuda_cores_gpu(dtype):
    """The CUDA-core GEMV's narrow-output settings (8 waves of 4-warp programs, 16 rows a warp) at odd
    sizes, fused split-K reduce."""
    _case(dtype, 1, 70, 96, 32, bias=True, config=dict(kind="fma"))
    _case(dtype, 1, 1000, 17408, 128, zeros=True, config=dict(kind="fma"))
    _case(dtype, 3, 5120, 17408, 128, config=dict(kind="fma"))


@pytest.mark.parametrize("dtype,m,zeros,bias", [(torch.bfloat16, 1, False, True), (torch.float16, 4, True, False),
                                                (torch.bfloat16, 13, True, True)])
@pytest.mark.parametrize("waves", [1, 64])
def test_gptq_gemv_mma(dtype, m, zeros, bias, waves):
    """The GEMV with the weight on the MMA's wide side (x^T the 16-column side): bf16 rows scaled into
    fp16 per tile, zero points through the column sums of x, one K range or many (fused reduce)."""
    _case(dtype, m, 70, 96, 32, zeros=zeros, bias=bias, config=dict(kind="mma", waves=waves))


@pytest.mark.parametrize("m", [1, 4])
def test_gptq_gemv_cuda_fallback(m):
    """kind="cuda" where the CUDA kernel cannot run (here: no GPU; on one, e.g. group sizes other than
    32/64/128): the next best kernel runs instead and is right."""
    _case(torch.bfloat16, m, 70, 96, 32, zeros=True, bias=True, config=dict(kind="cuda"))
    _case(torch.float16, m, 70, 96, 48, config=dict(kind="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 4, 16])
def test_gptq_gemv_mma_gpu(dtype, m):
    """The wide-side GEMV on the GPU: odd sizes (masked tiles), then the 27B shapes (unmasked)."""
    cfg = dict(kind="mma")
    _case(dtype, m, 70, 96, 32, zeros=True, bias=True, config=cfg)
    _case(dtype, m, 34816, 5120, 128, zeros=m == 4, config=cfg)
    _case(dtype, m, 5120, 17408, 128, bias=True, config=cfg)


@pytest.mark.gpu
def test_gptq_gemv_mma_bf16_range_gpu():
    """bf16 rows beyond fp16's range (one tile at 1e6) and below its normals (a row at 1e-6): the
    per-tile power-of-two scaling keeps both (checked row by row)."""
    from qv.kernels.linear.triton import linear as linear_triton

    dtype = torch.bfloat16
    w = gptq_weight(256, 512, 128, False, False, dtype)
    x = randn(2, 512, dtype=torch.float32)
    x[0, :128] *= 1e6
    x[1] *= 1e-6
    x = x.to(dtype)
    out = run_triton(linear_triton, x, w, None, config=dict(kind="mma"))
    ref = run_reference(K.linear, x, w, None)
    for r in range(2):
        assert_close(f"linear (wide-side GEMV, bf16 range, row {r})", out[r], ref[r], BOUND[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gptq_gemm(dtype):
    _case(dtype, 37, 50, 128, 64, zeros=True, bias=True)


@pytest.mark.parametrize("cfg", [dict(kind="dot", x_f16=True), dict(kind="dot", x_f16=True, asm=True, waves=2)])
def test_gptq_decode_batch_variants(cfg):
    """The 17-64-row tiles with bf16 rows scaled into fp16 by one kernel first (rows_to_f16, undone per row
    after the dot), the byte-permute codes and fewer split-K waves: the variants bench/gemm_rows.py sweeps."""
    _case(torch.bfloat16, 37, 50, 128, 64, zeros=True, bias=True, config=cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [dict(kind="dot", x_f16=True, asm=True), dict(kind="dot", asm=True, waves=2)])
def test_gptq_decode_batch_variants_gpu(cfg):
    _case(torch.bfloat16, 64, 5120, 17408, 128, config=cfg)
    _case(torch.bfloat16, 40, 34816, 5120, 128, zeros=True, config=cfg)


def test_gptq_sequential_is_checked_once():
    """GPTQWeight.is_sequential: g_idx = k // group_size or not, found at the first call and kept in the
    declared `sequential` field (which equality ignores); .to() copies start unchecked."""
    w = gptq_weight(32, 64, 16, False, False, torch.float32)
    shuffled = gptq_weight(32, 64, 16, False, True, torch.float32)
    assert w.sequential is None and w.is_sequential() and w.sequential is True
    assert not shuffled.is_sequential() and shuffled.sequential is False
    w.g_idx = shuffled.g_idx  # a cached answer is not recomputed
    assert w.is_sequential()
    assert w.to("cpu").sequential is None and w == GPTQWeight(w.qweight, w.scales, w.zeros, w.g_idx, 16)


@pytest.mark.parametrize("m", [3, 20])
def test_gptq_act_order(m):
    _case(torch.float32, m, 40, 64, 16, zeros=True, act_order=True)


def test_gptq_single_group():
    _case(torch.float16, 2, 33, 80, 80)  # group = K = 80: tiles of 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense(dtype):
    x, w, b = randn(9, 40, dtype=dtype), randn(30, 40, dtype=dtype), randn(30, dtype=dtype)
    assert_close("dense linear", run_triton(K.linear, x, w, b), run_reference(K.linear, x, w, b), BOUND[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m", [1, 4, 16, 40, 64, 300])
def test_gptq_real_shapes(dtype, m):
    _case(dtype, m, 34816, 5120, 128, zeros=m == 4)
    _case(dtype, m, 5120, 17408, 128, bias=m == 16)
    _case(dtype, m, 1000, 5120, 128, act_order=True)


@pytest.mark.parametrize("dtype,act_order", [(torch.float32, True), (torch.bfloat16, False), (torch.float16, False)])
def test_gptq_dequant_cublas(dtype, act_order):
    """The large-M path (W dequantized once, then cuBLAS), forced at a small M."""
    from qv.kernels.linear.triton import linear as linear_triton

    w = gptq_weight(45, 96, 32, True, act_order, dtype)
    x, b = randn(21, 96, dtype=dtype), randn(45, dtype=dtype)
    out = run_triton(linear_triton, x, w, b, config=dict(dequant_min_m=1))
    assert_close("linear (dequant + cuBLAS)", out, run_reference(K.linear, x, w, b), BOUND[dtype])


@pytest.mark.parametrize("dtype,act_order", [(torch.float32, True), (torch.bfloat16, False), (torch.float16, True)])
def test_gptq_chunked_dequant_cublas(dtype, act_order):
    """The prompt-chunk path: W dequantized 16 output columns at a time (the last chunk narrower) and each chunk
    multiplied by cuBLAS into its columns of out, bias sliced alike."""
    from qv.kernels.linear.triton import linear as linear_triton

    w = gptq_weight(45, 96, 32, True, act_order, dtype)
    x, b = randn(21, 96, dtype=dtype), randn(45, dtype=dtype)
    out = run_triton(linear_triton, x, w, b, config=dict(kind="chunked", cols=16))
    assert_close("linear (chunked dequant + cuBLAS)", out, run_reference(K.linear, x, w, b), BOUND[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("m", [9, 16, 17, 40, 64, 65, 300, 511, 512, 4096])
def test_gptq_rows_dispatch_gpu(m):
    """Every row band of the sm_90 dispatch (configs.gemv_kind: GEMV, tensor-core GEMM tiles by rows, chunked
    dequantization) at 27B shapes, sequential and act-order, asymmetric zeros and bias."""
    _case(torch.bfloat16, m, 5120, 17408, 128, zeros=True, bias=True)
    _case(torch.bfloat16, m, 1000, 5120, 128, act_order=True)


def test_few_row_limit_names_the_row_where_the_chunked_path_starts(monkeypatch):
    """The step planner's edge (few_row_limit): the last row count before gemv_kind says "chunked", for GPTQ weights
    on the Triton backend of a GPU whose dispatch has that band; None for dense weights, the CPU, other chains."""
    from qv.kernels.linear import configs, few_row_limit

    w = gptq_weight(45, 96, 32, True, False, torch.bfloat16)
    assert few_row_limit(w, torch.device("cpu"), torch.bfloat16) is None
    monkeypatch.setattr("qv.kernels.registry.chain_for", lambda device: ("triton", "reference"))
    monkeypatch.setattr(configs, "gemv_kind", lambda device, m, dtype: "chunked" if m >= 65 else "tc")
    cuda = torch.device("cuda")
    assert few_row_limit(w, cuda, torch.bfloat16) == configs.CHUNKED_ROWS - 1 == 64
    assert few_row_limit(torch.zeros(45, 96), cuda, torch.bfloat16) is None
    monkeypatch.setattr(configs, "gemv_kind", lambda device, m, dtype: "dot")
    assert few_row_limit(w, cuda, torch.bfloat16) is None
    monkeypatch.setattr("qv.kernels.registry.chain_for", lambda device: ("sm70", "triton", "reference"))
    assert few_row_limit(w, cuda, torch.bfloat16) is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gptq_large_m_real_shapes(dtype):
    _case(dtype, 1100, 5120, 17408, 128, zeros=True, bias=True)
    _case(dtype, 1024, 1000, 5120, 128, act_order=True)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("dtype,m,zeros,bias", [(torch.float32, 1, True, True), (torch.bfloat16, 3, False, True),
                                                (torch.float16, 4, True, False)])
def test_gptq_gemv_split_reduce(fused, dtype, m, zeros, bias):
    """The CUDA-core GEMV's split-K reduce: a second launch, or (fused) the last program of each column
    tile summing the partials. Two column tiles, many splits; a rerun gives the same bits and the fused
    path leaves its tickets at zero (so a replayed CUDA graph starts from zeros)."""
    from qv.kernels.linear import triton_gemv
    from qv.kernels.linear.triton import linear as linear_triton

    w = gptq_weight(300, 256, 32, zeros, False, dtype)
    x = randn(m, 256, dtype=dtype)
    b = randn(300, dtype=dtype) if bias else None
    cfg = dict(kind="fma", fused=fused, waves=64)
    out = run_triton(linear_triton, x, w, b, config=cfg)
    assert_close("linear (CUDA-core GEMV, split-K)", out, run_reference(K.linear, x, w, b), BOUND[dtype])
    assert torch.equal(run_triton(linear_triton, x, w, b, config=cfg), out)
    assert all(int(t.abs().sum()) == 0 for t in triton_gemv._TICKETS.values())
    if fused:
        assert triton_gemv._TICKETS, "the fused reduce did not run"
