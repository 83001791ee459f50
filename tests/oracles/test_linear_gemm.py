"""The tensor-core GPTQ GEMM (qv/kernels/linear/triton_gemm.py) against the fp32 reference over the same
codes: both operand orders (SWAP: the converted weight as the MMA's A operand), fp16 and bf16 rows (bf16
scaled into fp16 per row, or multiplied in bf16), symmetric and asymmetric zeros, bias, split-K, M/N/K off
the tiles and a K that ends inside a group. Outputs start poisoned (NaN), so an unwritten element fails."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import BOUND, DEV, nan_empty, randn, run_reference
from qv import kernels as K
from qv.kernels.linear import GPTQWeight
from qv.kernels.linear.triton_gemm import gemm
from util import assert_close

TILES = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4, STAGES=1, GROUP_M=2)


def weight(n, k, group, zeros, dtype):
    groups = -(-k // group)
    return GPTQWeight(torch.randint(0, 256, (k, n), dtype=torch.uint8, device=DEV),
                      (torch.rand(groups, n, device=DEV) * 0.02 + 1e-3).to(dtype),
                      torch.randint(96, 160, (groups, n), device=DEV).to(dtype) if zeros else None,
                      torch.arange(k, dtype=torch.int32, device=DEV) // group, group)


def check(m, n, k, group, dtype, zeros=False, bias=False, **cfg):
    w = weight(n, k, group, zeros, dtype)
    x = randn(m, k, dtype=dtype)
    b = randn(n, dtype=dtype) if bias else None
    with nan_empty():
        out = torch.empty(m, n, dtype=dtype, device=DEV)
        assert gemm(x, w, b, out, dict(TILES, **cfg))
    assert_close("gptq gemm", out, run_reference(K.linear, x, w, b), BOUND[dtype])


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gemm_tiles_and_zeros(swap, dtype):
    torch.manual_seed(1)
    check(37, 80, 192, 64, dtype, zeros=True, bias=True, SWAP=swap)


@pytest.mark.parametrize("swap", [False, True])
def test_gemm_split_k_and_odd_rows(swap):
    torch.manual_seed(2)
    check(5, 48, 256, 64, torch.bfloat16, split=3, SWAP=swap)


@pytest.mark.parametrize("swap", [False, True])
def test_gemm_bf16_products(swap):
    """f16=False: bf16 rows multiply a bf16-dequantized tile (no row scaling pass)."""
    torch.manual_seed(3)
    check(21, 64, 128, 32, torch.bfloat16, zeros=True, f16=False, SWAP=swap)


def test_gemm_k_ends_inside_a_group_is_refused_without_tma():
    """Without the copy engine's zero fill a K that is not a whole number of K tiles is not this kernel's:
    gemm says so (False) and launches nothing, and the caller runs another kernel."""
    w = weight(32, 200, 64, False, torch.float16)
    x = randn(4, 200, dtype=torch.float16)
    out = torch.full((4, 32), float("nan"), dtype=torch.float16, device=DEV)
    if DEV.type == "cpu":
        assert not gemm(x, w, None, out, dict(TILES))
        assert out.isnan().all()


@pytest.mark.gpu
@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("m", [9, 64, 300, 2100])
def test_gemm_gpu(swap, m):
    """On Hopper through TMA: rows past M and K arrive as zeros (K = 5000 ends inside a group)."""
    torch.manual_seed(4)
    check(m, 640, 5000, 128, torch.bfloat16, zeros=True, bias=True, SWAP=swap, BLOCK_M=64, BLOCK_N=128,
          BLOCK_K=64, num_warps=4, STAGES=3)
    check(m, 512, 1024, 128, torch.float16, SWAP=swap, BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, STAGES=3,
          split=3)
