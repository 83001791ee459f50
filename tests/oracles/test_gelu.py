"""gelu, exact and tanh-approximated, against the reference."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import BOUND, K, randn, run_reference, run_triton
from util import assert_close


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype,shape", [(torch.float32, (5, 37)), (torch.bfloat16, (2, 3, 11)),
                                         pytest.param(torch.bfloat16, (4096, 4304), marks=pytest.mark.gpu)])
def test_gelu(dtype, shape, approximate):
    x = randn(*shape, dtype=dtype, scale=3.0)
    assert_close("gelu", run_triton(K.gelu, x, approximate), run_reference(K.gelu, x, approximate), BOUND[dtype])
