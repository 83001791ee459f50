"""rms_norm against the reference: zero-centred (1 + w) and plain weight, with and without the
residual add (both returned tensors), odd widths, non-contiguous row views."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import BOUND, K, randn, run_reference, run_triton
from util import assert_close


def _case(dtype, rows, d, residual, zero_centered):
    x, w = randn(rows, d, dtype=dtype), randn(d, scale=0.1)
    r = randn(rows, d, dtype=dtype) if residual else None
    args = (x, w, 1e-6, r, zero_centered)
    ours, ref = run_triton(K.rms_norm, *args), run_reference(K.rms_norm, *args)
    if residual:
        assert_close("rms_norm", ours[0], ref[0], BOUND[dtype])
        assert torch.equal(ours[1], ref[1]), "residual sum differs"
    else:
        assert_close("rms_norm", ours, ref, BOUND[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("residual,zero_centered", [(False, True), (True, True), (False, False)])
def test_rms_norm(dtype, residual, zero_centered):
    _case(dtype, 7, 37, residual, zero_centered)


def test_rms_norm_strided_rows():
    x = randn(5, 3, 40)[:, 1, :]  # rows 120 elements apart
    w = randn(40, scale=0.1)
    assert_close("rms_norm", run_triton(K.rms_norm, x, w, 1e-6), run_reference(K.rms_norm, x, w, 1e-6), 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_real_shapes(dtype):
    _case(dtype, 4099, 5120, True, True)
    _case(dtype, 24 * 1000, 256, False, True)
