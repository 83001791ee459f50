"""gated_rms_norm (GDN output norm: plain weight, SiLU gate) against the reference."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import BOUND, K, randn, run_reference, run_triton
from util import assert_close


def _case(dtype, rows, d):
    x, z, w = randn(rows, d, dtype=dtype), randn(rows, d, dtype=dtype), randn(d)
    args = (x, z, w, 1e-6)
    assert_close("gated_rms_norm", run_triton(K.gated_rms_norm, *args), run_reference(K.gated_rms_norm, *args),
                 BOUND[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm(dtype):
    _case(dtype, 11, 24)


@pytest.mark.gpu
def test_gated_rms_norm_real_shapes():
    _case(torch.bfloat16, 48 * 1000, 128)
