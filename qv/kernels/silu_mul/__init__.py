"""SiLU-and-multiply of the fused gate/up projection (the SwiGLU MLP)."""

from __future__ import annotations

import torch

from qv.kernels.registry import impl


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = [gate | up] -> silu(gate) * up [T, I]."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_mul: last dim {x.shape[-1]} is odd")
    return impl("silu_mul", x.device)(x)
