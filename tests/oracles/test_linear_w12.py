"""linear over W12 weights (12-bit codes packed at load from a dense bf16/fp16 weight, one scale per row)
against the fp32 reference that dequantizes the same codes: the FMA GEMV, widened tensor-core tiles (bf16
activations as two exact dots), widened chunks + cuBLAS, the sm70 chain; odd M/N/K (an odd K leaves a half-used
high-nibble byte), bias, split-K. And the packing itself: every weight within half a step of its code."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import BOUND, DEV, K, randn, run_reference, run_triton
from qv.kernels.linear import W12Weight, pack_w12
from qv.kernels.linear.reference import dequantize_w12
from util import assert_close, rel_err


def w12_weight(n, k):
    return pack_w12(randn(n, k, dtype=torch.bfloat16, scale=0.05))


def _case(dtype, m, n, k, bias=False, config=None):
    from qv.kernels.linear.triton import linear as linear_triton

    w = w12_weight(n, k)
    x = randn(m, k, dtype=dtype)
    b = randn(n, dtype=dtype) if bias else None
    out = run_triton(K.linear, x, w, b) if config is None else run_triton(linear_triton, x, w, b, config=config)
    return assert_close("linear w12", out, run_reference(K.linear, x, w, b), BOUND[dtype])


def test_pack_w12_layout_and_error():
    """Codes in -2047..2047 with the row's largest magnitude at +-2047, the nibble layout as documented (checked
    by hand on one row), every weight within half a step, and the relative RMS error at a 27B q_proj shape."""
    w = torch.tensor([[1.0, -0.5, 0.25, 2047 / 2047 * -1.0, 0.0]])
    p = pack_w12(w)
    assert p.lo.shape == (1, 5) and p.hi.shape == (1, 3)
    codes = p.codes()
    assert codes.tolist() == [[2047, -1024, 512, -2047, 0]]  # -1023.5 rounds to even
    stored = codes + 2048
    assert int(p.hi[0, 1]) == (int(stored[0, 2]) >> 8) | ((int(stored[0, 3]) >> 8) << 4)
    big = torch.randn(1024, 777).bfloat16()
    q = pack_w12(big)
    deq = dequantize_w12(q)
    assert ((deq - big.float()).abs() <= q.scale[:, None] * (0.5 + 1e-3)).all()  # ties after fp32 rounding
    assert rel_err(deq, big.float()) < 1e-3  # 4.5-sigma rows: step / sqrt(12) / sigma ~ 6e-4
    with pytest.raises(ValueError, match="do not fit"):
        W12Weight(q.lo, q.hi[:, 1:], q.scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 3])
def test_w12_gemv(dtype, m):
    _case(dtype, m, 70, 97, bias=m == 3)
    _case(dtype, m, 40, 200, config=dict(kind="fma", split=1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_w12_widen_dot(dtype):
    """Tensor-core tiles: bf16 rows against the codes' high and low parts (exact), fp16 and fp32 in one dot."""
    _case(dtype, 13, 70, 97, bias=True)
    _case(dtype, 21, 48, 160, config=dict(kind="dot", split=1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w12_chunked(dtype):
    _case(dtype, 19, 70, 97, bias=True, config=dict(kind="chunked", cols=24))


def test_w12_sm70_chain():
    from qv.kernels.linear.cuda_sm70 import linear as linear_sm70

    w = w12_weight(70, 97)
    for m in (9, 17):
        x = randn(m, 97, dtype=torch.float16)
        with K.backend("sm70"):
            out = linear_sm70(x, w)
        assert_close("linear w12 sm70", out, run_reference(K.linear, x, w), BOUND[torch.float16])


def test_w12_oracle_detects_a_wrong_nibble():
    """The oracle can fail: one high nibble changed moves the output past the fp32 bound."""
    w = w12_weight(70, 96)
    x = randn(3, 96)
    good = run_reference(K.linear, x, w)
    w.hi[5, 7] ^= 1
    assert rel_err(run_triton(K.linear, x, w), good) > 100 * BOUND[torch.float32]


def test_w8a8_is_refused_for_w12():
    from qv.kernels.linear.triton import linear as linear_triton

    with pytest.raises(ValueError, match="W8A8 takes FP8"):
        linear_triton(randn(130, 64, dtype=torch.bfloat16), w12_weight(32, 64), None, config=dict(kind="w8a8"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind,m", [("fma", 1), ("fma", 4), ("dot", 16), ("dot", 64), ("chunked", 300),
                                    ("chunked", 4096)])
def test_w12_paths_27b_shapes_gpu(dtype, kind, m):
    """Every path at the 27B attention projections: q_proj (with its gate) 5120 -> 12288, k/v 5120 -> 1024."""
    from qv.kernels.linear.triton import linear as linear_triton

    for n in (12288, 1024):
        w = w12_weight(n, 5120)
        x = randn(m, 5120, dtype=dtype)
        out = run_triton(linear_triton, x, w, None, config=dict(kind=kind))
        assert_close(f"linear w12 {kind}", out, run_reference(K.linear, x, w), BOUND[dtype])
