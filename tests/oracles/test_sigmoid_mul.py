"""sigmoid_mul (the attention output gate) against the reference."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import BOUND, K, randn, run_reference, run_triton
from util import assert_close


@pytest.mark.parametrize("dtype,rows,d", [(torch.float32, 5, 37), (torch.float16, 4, 96),
                                          pytest.param(torch.bfloat16, 1000, 6144, marks=pytest.mark.gpu)])
def test_sigmoid_mul(dtype, rows, d):
    x, g = randn(rows, d, dtype=dtype), randn(rows, d, dtype=dtype, scale=4.0)
    assert_close("sigmoid_mul", run_triton(K.sigmoid_mul, x, g), run_reference(K.sigmoid_mul, x, g), BOUND[dtype])
