"""Rotary embedding over the whole head dim with given angles (the vision tower)."""

from __future__ import annotations

import torch

from qv.kernels.registry import impl


def rotary_embed(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary over the whole head dim with given angles. x [T, H, D]; cos, sin [T, D]."""
    if cos.shape != (x.shape[0], x.shape[-1]) or sin.shape != cos.shape:
        raise ValueError(f"rotary_embed: x {tuple(x.shape)}, cos {tuple(cos.shape)}")
    return impl("rotary_embed", x.device)(x, cos, sin)
