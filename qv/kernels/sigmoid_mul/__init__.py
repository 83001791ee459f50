"""x * sigmoid(gate): the gated attention output."""

from __future__ import annotations

import torch

from qv.kernels.registry import impl


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate), same shapes (the gated attention output)."""
    if x.shape != gate.shape:
        raise ValueError(f"sigmoid_mul: x {tuple(x.shape)} != gate {tuple(gate.shape)}")
    return impl("sigmoid_mul", x.device)(x, gate)
