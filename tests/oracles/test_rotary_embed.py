"""rotary_embed (vision tower: full head dim, given cos/sin) against the reference."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import BOUND, K, randn, run_reference, run_triton
from util import assert_close


@pytest.mark.parametrize("dtype,t,h,d", [(torch.float32, 5, 3, 72), (torch.bfloat16, 4, 2, 16),
                                         pytest.param(torch.bfloat16, 4096, 16, 72, marks=pytest.mark.gpu)])
def test_rotary_embed(dtype, t, h, d):
    x = randn(t, h, d, dtype=dtype)
    ang = randn(t, d, scale=3.0)  # the two halves need not share angles
    cos, sin = ang.cos(), ang.sin()
    assert_close("rotary_embed", run_triton(K.rotary_embed, x, cos, sin), run_reference(K.rotary_embed, x, cos, sin),
                 BOUND[dtype])
