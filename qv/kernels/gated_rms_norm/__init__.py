"""Gated RMSNorm: norm(x) * w * silu(gate) per row (the Gated DeltaNet output norm)."""

from __future__ import annotations

import torch

from qv.kernels.registry import impl


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """norm(x) * w * silu(gate) per row. x, gate [N, D]; weight [D] (plain, not 1 + w)."""
    if x.shape != gate.shape or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"gated_rms_norm: x {tuple(x.shape)}, gate {tuple(gate.shape)}, weight {tuple(weight.shape)}")
    return impl("gated_rms_norm", x.device)(x, gate, weight, eps)
