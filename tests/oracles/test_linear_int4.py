"""The W4A16 linear (4-bit GPTQWeight: GPTQ-Int4 and AWQ at run time) against the fp32 reference.

Triton (triton_int4.py): the tiled GEMM/GEMV at any M, odd N and K not a multiple of the tiles,
symmetric and asymmetric zeros, act-order g_idx (the gather path), bias, split-K and the dequantize +
cuBLAS path; outputs allocated NaN-poisoned inside the kernel under test (kernel_cases.nan_empty).
The reference's own 4-bit dequantization is checked against a loop over the nibbles here, so the
oracle is not the code under test. On CPU the Triton kernels run in the interpreter at tiny shapes.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from kernel_cases import BOUND, DEV, K, randn, run_reference, run_triton
from qv.kernels.linear import GPTQWeight, pack_nibbles, unpack_nibbles
from qv.kernels.linear.reference import dequantize_gptq
from util import assert_close


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def int4_weight(n, k, group, zeros, act_order, dtype):
    g = torch.arange(k, dtype=torch.int32, device=DEV) // group
    if act_order:
        g = g[torch.randperm(k, device=DEV)]
    n_groups = -(-k // group)
    return GPTQWeight(
        torch.randint(0, 256, (k // 2, n), dtype=torch.uint8, device=DEV),
        (torch.rand(n_groups, n, device=DEV) * 0.2 + 1e-2).to(dtype),
        torch.randint(0, 16, (n_groups, n), device=DEV).to(dtype) if zeros else None,
        g, group, bits=4)


def _case(dtype, m, n, k, group, zeros=False, act_order=False, bias=False, config=None):
    from qv.kernels.linear.triton import linear as linear_triton

    w = int4_weight(n, k, group, zeros, act_order, dtype)
    x = randn(m, k, dtype=dtype)
    b = randn(n, dtype=dtype) if bias else None
    out = run_triton(K.linear, x, w, b) if config is None else run_triton(linear_triton, x, w, b, config=config)
    assert_close(f"int4 linear m={m} n={n} k={k} g={group}", out, run_reference(K.linear, x, w, b), BOUND[dtype])


def test_reference_dequantizes_nibbles():
    """dequantize_gptq at 4 bits against a loop: byte row r = input 2r (low nibble), 2r + 1 (high)."""
    w = int4_weight(6, 8, 4, True, True, torch.float32)
    sym = GPTQWeight(w.qweight, w.scales, None, w.g_idx, 4, bits=4)
    got, got_sym = dequantize_gptq(w), dequantize_gptq(sym)
    for kk in range(8):
        for nn in range(6):
            byte = int(w.qweight[kk // 2, nn])
            c = (byte >> 4) if kk % 2 else (byte & 15)
            g = int(w.g_idx[kk])
            s = float(w.scales[g, nn])
            assert got[nn, kk] == (c - float(w.zeros[g, nn])) * s
            assert got_sym[nn, kk] == (c - 8) * s
    codes = torch.randint(0, 16, (10, 7), dtype=torch.uint8)
    assert torch.equal(unpack_nibbles(pack_nibbles(codes)), codes) and w.in_features == 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 5, 13])
def test_int4_gemv(dtype, m):
    _case(dtype, m, 70, 96, 32, zeros=m == 5, bias=m == 13)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [17, 37])
def test_int4_gemm(dtype, m):
    _case(dtype, m, 50, 128, 64, zeros=True, bias=True)


@pytest.mark.parametrize("m", [3, 20])
@pytest.mark.parametrize("zeros", [False, True])
def test_int4_act_order(m, zeros):
    _case(torch.float32, m, 40, 64, 16, zeros=zeros, act_order=True)


def test_int4_group_not_a_tile_multiple():
    """Group 16 (< the 32-row minimum tile) and one group of K = 70 rows: both take the gather path."""
    _case(torch.float32, 2, 33, 96, 16, zeros=True)
    _case(torch.float16, 3, 33, 70, 70)


@pytest.mark.parametrize("waves", [1, 64])
def test_int4_split_k(waves):
    """K cut into one range or many (fp32 partials summed by a second launch, bias added there)."""
    _case(torch.float32, 1, 300, 256, 32, zeros=True, bias=True, config=dict(waves=waves, split=None))


@pytest.mark.parametrize("dtype,act_order", [(torch.float32, True), (torch.bfloat16, False), (torch.float16, False)])
def test_int4_dequant_cublas(dtype, act_order):
    """The large-M path (W dequantized once, then cuBLAS), forced at a small M; symmetric and asymmetric."""
    _case(dtype, 21, 45, 96, 32, zeros=True, act_order=act_order, bias=True, config=dict(dequant_min_m=1))
    _case(dtype, 9, 45, 96, 32, act_order=act_order, config=dict(dequant_min_m=1))


def test_int4_shape_errors():
    w = int4_weight(8, 32, 32, False, False, torch.float32)
    with pytest.raises(ValueError, match="in_features 32"):
        K.linear(randn(2, 64), w)
    from qv.kernels.linear.triton import linear as linear_triton

    with pytest.raises(ValueError, match="kind"):  # the 8-bit GEMV choices do not apply
        linear_triton(randn(2, 32), w, None, config=dict(kind="fma"))
    with pytest.raises(ValueError, match="bits=3"):
        GPTQWeight(w.qweight, w.scales, None, w.g_idx, 32, bits=3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m", [1, 4, 16, 40, 64, 300, 1100])
def test_int4_real_shapes_gpu(dtype, m):
    """The 27B's shapes (unmasked tiles), act-order at an odd N, every row regime incl. dequantize + cuBLAS."""
    _case(dtype, m, 34816, 5120, 128, zeros=m == 4)
    _case(dtype, m, 5120, 17408, 128, bias=m == 16, zeros=True)
    _case(dtype, m, 1000, 5120, 128, act_order=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 7, 13, 33, 129])
def test_int4_odd_shapes_gpu(dtype, m):
    _case(dtype, m, 70, 96, 32, zeros=True, bias=True)
    _case(dtype, m, 1001, 2048, 64, zeros=m % 2 == 1)
    _case(dtype, m, 257, 4096, 32, act_order=True, zeros=True)
