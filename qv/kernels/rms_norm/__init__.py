"""RMSNorm over the last dim, optionally fused with the residual add (the decoder's norms)."""

from __future__ import annotations

import torch

from qv.kernels.registry import impl


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             zero_centered: bool = True):
    """RMSNorm over the last dim. x [T, D], weight [D]; scale (1 + w) if zero_centered else w.

    With `residual` [T, D]: s = x + residual (in x's dtype) is normalised and (norm(s), s) returned.
    """
    if x.shape[-1] != weight.shape[0]:
        raise ValueError(f"rms_norm: x last dim {x.shape[-1]} != weight {weight.shape[0]}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"rms_norm: residual {tuple(residual.shape)} != x {tuple(x.shape)}")
    return impl("rms_norm", x.device)(x, weight, eps, residual, zero_centered)
