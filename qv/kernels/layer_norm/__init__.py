"""LayerNorm over the last dim (the vision tower's norms)."""

from __future__ import annotations

import torch

from qv.kernels.registry import impl


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim. x [T, D], weight/bias [D]."""
    return impl("layer_norm", x.device)(x, weight, bias, eps)
