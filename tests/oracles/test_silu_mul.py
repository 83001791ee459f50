"""silu_mul ([gate | up] -> silu(gate) * up) against the reference."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import BOUND, K, randn, run_reference, run_triton
from util import assert_close


@pytest.mark.parametrize("dtype,rows,inner", [(torch.float32, 5, 37), (torch.bfloat16, 3, 160),
                                              pytest.param(torch.bfloat16, 1000, 17408, marks=pytest.mark.gpu)])
def test_silu_mul(dtype, rows, inner):
    x = randn(rows, 2 * inner, dtype=dtype, scale=3.0)
    assert_close("silu_mul", run_triton(K.silu_mul, x), run_reference(K.silu_mul, x), BOUND[dtype])
