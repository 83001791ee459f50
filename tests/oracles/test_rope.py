"""rope against the reference: partial rotary, 1-D positions, mRoPE (t, h, w) positions with
interleaved and contiguous sections, GQA head counts, large positions (angle reduction)."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import BOUND, DEV, K, randn, run_reference, run_triton
from util import assert_close


def _case(dtype, t, hq, hk, d, rotary_dim, positions, section=None, interleaved=False):
    q, k = randn(t, hq, d, dtype=dtype), randn(t, hk, d, dtype=dtype)
    ref = run_reference(K.rope, q.clone(), k.clone(), positions, rotary_dim, 1e7, section, interleaved)
    ours = run_triton(K.rope, q.clone(), k.clone(), positions, rotary_dim, 1e7, section, interleaved)
    assert_close("rope q", ours[0], ref[0], BOUND[dtype])
    assert_close("rope k", ours[1], ref[1], BOUND[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_1d(dtype):
    _case(dtype, 7, 6, 1, 32, 8, torch.randint(0, 300_000, (7,), device=DEV))


@pytest.mark.parametrize("interleaved", [True, False])
def test_mrope(interleaved):
    _case(torch.float32, 5, 4, 2, 16, 16, torch.randint(0, 5000, (3, 5), device=DEV), (4, 2, 2), interleaved)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_real_shapes(dtype):
    pos = torch.randint(0, 262_144, (3, 2000), device=DEV)
    _case(dtype, 2000, 24, 4, 256, 64, pos[0])
    _case(dtype, 2000, 24, 4, 256, 64, pos, (11, 11, 10), True)
