"""varlen_attention (dense packed sequences, the vision tower's attention) against the reference:
non-causal and causal, GQA, head dim 72 (not a power of two), empty and single-token sequences."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import BOUND, K, cu_seqlens, nan_empty, randn, run_reference, run_triton
from util import assert_close


def run_sm70(fn, *args):
    with K.backend("sm70"), nan_empty():
        return fn(*args)


def _case(dtype, hkv, rep, d, lens, causal, run=run_triton):
    t = sum(lens)
    q, k, v = randn(t, hkv * rep, d, dtype=dtype), randn(t, hkv, d, dtype=dtype), randn(t, hkv, d, dtype=dtype)
    args = (q, k, v, cu_seqlens(lens), d ** -0.5, causal, max(lens))
    assert_close("varlen_attention", run(K.varlen_attention, *args), run_reference(K.varlen_attention, *args),
                 BOUND[dtype])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype,hkv,rep,d", [(torch.float32, 2, 2, 72), (torch.float16, 1, 3, 32)])
def test_varlen_attention_sm70_sdpa(dtype, hkv, rep, d, causal):
    """The sm70 chain's torch SDPA path (no tl.dot), empty and single-token sequences included."""
    _case(dtype, hkv, rep, d, [7, 0, 1, 12, 19], causal, run_sm70)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype,hkv,rep,d", [(torch.float32, 2, 2, 72), (torch.bfloat16, 3, 1, 16),
                                             (torch.float16, 1, 3, 32)])
def test_varlen_attention(dtype, hkv, rep, d, causal):
    _case(dtype, hkv, rep, d, [7, 0, 1, 12, 19], causal)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_varlen_attention_vision_shapes(dtype):
    _case(dtype, 16, 1, 72, [1024, 300, 1, 4096], False)
