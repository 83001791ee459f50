"""causal_conv1d against the reference: outputs and the whole conv-state pool (slots not in the
batch must stay untouched), prefill chunks with and without initial state, decode steps, empty
and single-token sequences, odd channel counts, state dtype different from the activations."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import BOUND, DEV, K, cu_seqlens, randn, run_reference, run_triton
from util import assert_close


def _case(dtype, state_dtype, c, width, lens, init, activation=True, max_q="auto"):
    n_slots = len(lens) + 3
    slots = torch.randperm(n_slots, device=DEV)[:len(lens)]
    x = randn(sum(lens), c, dtype=dtype)
    w = randn(c, width, dtype=dtype, scale=0.5)
    pool = randn(n_slots, width - 1, c, dtype=state_dtype)
    ours, ref = pool.clone(), pool.clone()
    args = (cu_seqlens(lens), slots, torch.tensor(init, device=DEV), activation,
            max(lens) if max_q == "auto" else max_q)
    y = run_triton(K.causal_conv1d, x, w, ours, *args)
    y_ref = run_reference(K.causal_conv1d, x, w, ref, *args)
    if sum(lens):
        assert_close("causal_conv1d", y, y_ref, BOUND[dtype])
    assert torch.equal(ours, ref), "conv state pool differs from the reference"


@pytest.mark.parametrize("dtype,state_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float16, torch.float32)])
def test_causal_conv1d_prefill(dtype, state_dtype):
    _case(dtype, state_dtype, 37, 4, [5, 0, 1, 2, 23], [True, True, False, True, False])


@pytest.mark.parametrize("activation", [True, False])
def test_causal_conv1d_decode(activation):
    _case(torch.float32, torch.float32, 70, 4, [1, 1, 1], [True, False, True], activation)


def test_causal_conv1d_unknown_max_len_and_width_2():
    _case(torch.float32, torch.float32, 9, 2, [3, 17], [True, False], max_q=None)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_causal_conv1d_real_shapes(dtype):
    _case(dtype, dtype, 10240, 4, [2000, 1, 0, 777], [True, True, False, False])
    _case(dtype, dtype, 10240, 4, [1] * 32, [True] * 32)
