"""GELU, exact or tanh-approximated (the vision tower's MLP)."""

from __future__ import annotations

import torch

from qv.kernels.registry import impl


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU, exact ("none") or tanh-approximated ("tanh")."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: approximate={approximate!r}")
    return impl("gelu", x.device)(x, approximate)
