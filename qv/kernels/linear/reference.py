"""fp32 linear over dense or dequantized GPTQ weights: the oracle of linear (arguments as in __init__.py)."""

from __future__ import annotations

import torch

from qv.kernels.linear import GPTQWeight


def dequantize_gptq(w) -> torch.Tensor:
    """fp32 [N, K] weight of a GPTQWeight: w[n, k] = (q[k, n] - zero[g(k), n]) * scale[g(k), n]."""
    q = w.codes().float()  # [K, N]
    zeros = torch.full_like(w.scales, float(w.symmetric_zero), dtype=torch.float32) if w.zeros is None else w.zeros.float()
    g = w.g_idx.long()
    deq = (q - zeros[g]) * w.scales.float()[g]
    return deq.t()


def linear(x, weight, bias=None):
    w = dequantize_gptq(weight) if isinstance(weight, GPTQWeight) else weight.float()
    y = x.float() @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
