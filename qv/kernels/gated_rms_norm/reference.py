"""fp32 gated RMSNorm: the oracle of gated_rms_norm (arguments as in __init__.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gated_rms_norm(x, gate, weight, eps):
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = y * weight.float() * F.silu(gate.float())
    return y.to(x.dtype)
