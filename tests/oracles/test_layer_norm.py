"""layer_norm (vision tower) against the reference."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import BOUND, K, randn, run_reference, run_triton
from util import assert_close


@pytest.mark.parametrize("dtype,rows,d", [(torch.float32, 6, 37), (torch.bfloat16, 3, 72),
                                          pytest.param(torch.bfloat16, 4096, 1152, marks=pytest.mark.gpu)])
def test_layer_norm(dtype, rows, d):
    x, w, b = randn(rows, d, dtype=dtype, scale=2.0) + 1.0, randn(d), randn(d)
    args = (x, w, b, 1e-6)
    assert_close("layer_norm", run_triton(K.layer_norm, *args), run_reference(K.layer_norm, *args), BOUND[dtype])
