"""linear over block-FP8 weights (FP8Weight) against the fp32 reference that dequantizes the same e4m3 values:
the weight-only paths (FMA GEMV, tensor-core widening, widened chunks + cuBLAS) at the activation dtype's
bounds, the W8A8 prefill path against the reference's emulation of its activation rounding (tight) and
against the plain reference (the bound measured for e4m3 activations). Odd M/N/K, partial scale blocks,
blocks smaller than the tiles, bias, split-K."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import BOUND, DEV, K, randn, run_reference, run_triton
from qv.kernels.linear import FP8Weight
from qv.kernels.linear.reference import FP8_MAX, dequantize_fp8, linear_w8a8, quantize_rows_fp8
from util import assert_close, rel_err

# W8A8 against the unrounded activations: e4m3's 3 mantissa bits give each activation a relative error of
# up to 1/16; measured about 2.6e-2 relative RMS on these Gaussian cases (docs/VALIDATION.md)
W8A8_BOUND = 4e-2


def fp8_weight(n, k, block=(128, 128), device=DEV):
    """Random e4m3 codes spread over the format's range, scales varying by block."""
    codes = (torch.randn(n, k, device=device) * 64).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    bn, bk = block
    scales = torch.rand(-(-n // bn), -(-k // bk), device=device) * 1e-3 + 1e-4
    return FP8Weight(codes, scales, block)


def _case(dtype, m, n, k, block, bias=False, config=None):
    from qv.kernels.linear.triton import linear as linear_triton

    w = fp8_weight(n, k, block)
    x = randn(m, k, dtype=dtype)
    b = randn(n, dtype=dtype) if bias else None
    out = run_triton(K.linear, x, w, b) if config is None else run_triton(linear_triton, x, w, b, config=config)
    return assert_close("linear fp8", out, run_reference(K.linear, x, w, b), BOUND[dtype])


def test_dequantize_matches_the_block_layout():
    """The reference's dequantization on a hand-built weight: each [bn, bk] block scaled by its own entry,
    partial blocks at the edges included."""
    codes = torch.tensor([[1.0, 2.0, -4.0], [0.5, -1.0, 448.0], [0.25, 3.0, -0.125]]).to(torch.float8_e4m3fn)
    scale = torch.tensor([[2.0, 10.0], [-1.0, 0.5]])
    w = FP8Weight(codes, scale, (2, 2))
    want = torch.tensor([[2.0, 4.0, -40.0], [1.0, -2.0, 4480.0], [-0.25, -3.0, -0.0625]])
    assert torch.equal(dequantize_fp8(w), want)
    with pytest.raises(ValueError, match="scale_inv shape"):
        FP8Weight(codes, scale[:1], (2, 2))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        FP8Weight(codes.float(), scale, (2, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 3])
def test_fp8_gemv(dtype, m):
    """The decode GEMV: FMAs on weights widened in registers, split-K, partial blocks."""
    _case(dtype, m, 70, 96, (32, 32), bias=m == 3)
    _case(dtype, m, 40, 200, (16, 64), config=dict(kind="fma", split=1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_widen_dot(dtype):
    """The tensor-core path for rows between decode and prefill: tiles widened to x's dtype for tl.dot."""
    _case(dtype, 13, 70, 96, (32, 32), bias=True)
    _case(dtype, 21, 48, 160, (16, 32), config=dict(kind="dot", split=1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_chunked(dtype):
    """Widened chunks + cuBLAS (the sm70 chain's prefill, other GPUs' long prompts), chunk boundaries inside
    the weight, and blocks of no power of two (only this path takes them)."""
    _case(dtype, 19, 70, 96, (32, 32), bias=True, config=dict(kind="chunked", cols=40))
    _case(dtype, 5, 50, 72, (10, 24))


def test_fp8_sm70_chain():
    """The sm70 chain (no tl.dot): the GEMV up to 16 rows, widened chunks above."""
    from qv.kernels.linear.cuda_sm70 import linear as linear_sm70

    w = fp8_weight(70, 96, (32, 32))
    for m in (9, 17):
        x = randn(m, 96, dtype=torch.float16)
        with K.backend("sm70"):
            out = linear_sm70(x, w)
        assert_close("linear fp8 sm70", out, run_reference(K.linear, x, w), BOUND[torch.float16])


def test_quantize_rows_kernel_matches_reference():
    """Per-token-group activation quantization: the kernel's codes and scales are the reference's."""
    from qv.kernels.linear.triton_fp8 import quantize_rows

    x = randn(7, 80, dtype=torch.bfloat16, scale=3.0)
    x[2, 5] = 1e4  # a group with an outlier: its other values become subnormal codes
    q, s = quantize_rows(x, 32)
    q_ref, s_ref = quantize_rows_fp8(x, 32)
    assert torch.allclose(s, s_ref, rtol=1e-6, atol=0)
    assert (q.float() != q_ref.float()).float().mean().item() < 1e-2  # division rounding may flip a tie
    assert_close("quantize_rows", q.float() * s.repeat_interleave(32, 1)[:, :80],
                 q_ref.float() * s_ref.repeat_interleave(32, 1)[:, :80], 1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_w8a8(dtype):
    """The FP8-tensor-core prefill path against the reference's emulation of its activation rounding, and
    against the exact reference at the measured bound."""
    w = fp8_weight(70, 200, (32, 64))
    x = randn(37, 200, dtype=dtype)
    b = randn(70, dtype=dtype)
    from qv.kernels.linear.triton import linear as linear_triton

    out = run_triton(linear_triton, x, w, b, config=dict(kind="w8a8"))
    assert_close("linear fp8 w8a8 (emulated rounding)", out, linear_w8a8(x, w, b), BOUND[dtype])
    assert_close("linear fp8 w8a8", out, run_reference(K.linear, x, w, b), W8A8_BOUND)


def test_oracle_detects_a_wrong_block_scale():
    """The oracle can fail: one block's scale changed moves the output well past the bound."""
    w = fp8_weight(70, 96, (32, 32))
    x = randn(3, 96)
    good = run_reference(K.linear, x, w)
    w.scale_inv[1, 2] *= 1.5
    out = run_triton(K.linear, x, w)
    assert rel_err(out, good) > 100 * BOUND[torch.float32]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind,m", [("fma", 1), ("fma", 4), ("dot", 16), ("dot", 64), ("chunked", 300),
                                    ("w8a8", 300), ("w8a8", 4096), ("scaled_mm", 300), ("scaled_mm", 4096)])
def test_fp8_paths_27b_shapes_gpu(dtype, kind, m):
    """Every path at 27B shapes (128x128 blocks): gate_up and down projections."""
    from qv.kernels.linear.triton import linear as linear_triton

    if kind == "w8a8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need sm_89+")
    if kind == "scaled_mm":
        from qv.kernels.linear.triton_fp8 import scaled_mm_available

        if not scaled_mm_available(torch.device(DEV)):
            pytest.skip("torch._scaled_mm takes no block scales on this GPU or build")
    for n, k in ((2 * 17408, 5120), (5120, 17408)):
        w = fp8_weight(n, k)
        x = randn(m, k, dtype=dtype)
        out = run_triton(linear_triton, x, w, None, config=dict(kind=kind))
        ref = linear_w8a8(x, w) if kind in ("w8a8", "scaled_mm") else run_reference(K.linear, x, w)
        assert_close(f"linear fp8 {kind}", out, ref, BOUND[dtype])


@pytest.mark.gpu
def test_fp8_default_paths_gpu():
    """The paths fp8_kind picks by default at each row count, bf16, against the exact reference (W8A8 rows at
    the activation-rounding bound)."""
    from qv.kernels.linear.triton_fp8 import W8A8_MIN_ROWS, fp8_kind

    w = fp8_weight(6144, 5120)
    for m in (1, 2, 8, 33, W8A8_MIN_ROWS, 2000):
        x = randn(m, 5120, dtype=torch.bfloat16)
        out = run_triton(K.linear, x, w)
        bound = W8A8_BOUND if fp8_kind(x.device, m, w) in ("w8a8", "scaled_mm") else BOUND[torch.bfloat16]
        assert_close(f"linear fp8 m={m}", out, run_reference(K.linear, x, w), bound)
