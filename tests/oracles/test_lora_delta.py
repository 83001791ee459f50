"""lora_delta against the reference, on a column slice of a larger output (as the model calls it),
rows in any order; other rows and columns must stay untouched."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import BOUND, DEV, K, randn, run_reference, run_triton
from qv.kernels.lora_delta.configs import LORA_GEMM_ROWS
from util import assert_close


def _case(dtype, t, n_total, lo, hi, k, r, rows):
    full = randn(t, n_total, dtype=dtype)
    x, a, b = randn(t, k, dtype=dtype), randn(r, k, dtype=dtype), randn(hi - lo, r, dtype=dtype)
    idx = torch.tensor(rows, dtype=torch.int64, device=DEV)
    ref = run_reference(K.lora_delta, full[:, lo:hi].clone(), x, idx, a, b, 0.25)
    ours_full = full.clone()
    out = run_triton(K.lora_delta, ours_full[:, lo:hi], x, idx, a, b, 0.25)
    assert_close("lora_delta", out, ref, BOUND[dtype])
    rest = torch.ones(n_total, dtype=torch.bool, device=DEV)
    rest[lo:hi] = False
    assert torch.equal(ours_full[:, rest], full[:, rest]), "columns outside the slice changed"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_delta(dtype):
    _case(dtype, 9, 70, 10, 47, 40, 4, [7, 0, 3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_delta_many_rows(dtype):
    """From LORA_GEMM_ROWS rows on, the GEMM path (a prefill chunk of a Clef record)."""
    rows = torch.randperm(40)[:LORA_GEMM_ROWS + 3].tolist()
    _case(dtype, 40, 70, 10, 47, 40, 8, rows)


@pytest.mark.gpu
@pytest.mark.parametrize("n_rows", [13, 2000])
def test_lora_delta_real_shapes(n_rows):
    """27B down_proj with the original stack's rank 256, few rows (per-row kernel) and a chunk's worth."""
    rows = torch.randperm(2048)[:n_rows].tolist()
    _case(torch.bfloat16, 2048, 5120 + 64, 0, 5120, 17408, 256, rows)
