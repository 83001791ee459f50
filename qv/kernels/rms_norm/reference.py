"""fp32 RMSNorm: the oracle of rms_norm (arguments as in __init__.py)."""

from __future__ import annotations

import torch


def rms_norm(x, weight, eps, residual=None, zero_centered=True):
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.float()
    y = y * (1.0 + w) if zero_centered else y * w
    return y.to(x.dtype) if residual is None else (y.to(x.dtype), x)
