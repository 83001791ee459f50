"""Small fused ops: RMSNorm (+residual), gated RMSNorm, RoPE/mRoPE, SiLU-mul, sigmoid gate,
and the vision tower's LayerNorm, GELU and full-dim rotary. Public wrappers: shapes, checks, dispatch."""

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


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """norm(x) * w * silu(gate) per row. x, gate [N, D]; weight [D] (plain, not 1 + w)."""
    if x.shape != gate.shape or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"gated_rms_norm: x {tuple(x.shape)}, gate {tuple(gate.shape)}, weight {tuple(weight.shape)}")
    return impl("gated_rms_norm", x.device)(x, gate, weight, eps)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = [gate | up] -> silu(gate) * up [T, I]."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_mul: last dim {x.shape[-1]} is odd")
    return impl("silu_mul", x.device)(x)


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate), same shapes (the gated attention output)."""
    if x.shape != gate.shape:
        raise ValueError(f"sigmoid_mul: x {tuple(x.shape)} != gate {tuple(gate.shape)}")
    return impl("sigmoid_mul", x.device)(x, gate)


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rotary_dim: int, theta: float,
         mrope_section: tuple[int, ...] | None = None, mrope_interleaved: bool = False):
    """NeoX-style rotary on the first `rotary_dim` dims of each head; returns (q, k).

    q [T, Hq, D], k [T, Hk, D]; positions [T] (1-D) or [3, T] (t, h, w) for mRoPE, where
    `mrope_section` splits the rotary_dim/2 frequency slots between t, h and w (interleaved
    THWTHW... when `mrope_interleaved`). Implementations may rotate q and k in place.
    """
    t = q.shape[0]
    if k.shape[0] != t or positions.shape[-1] != t or positions.dim() not in (1, 2):
        raise ValueError(f"rope: q {tuple(q.shape)}, k {tuple(k.shape)}, positions {tuple(positions.shape)}")
    if rotary_dim > q.shape[-1] or rotary_dim % 2:
        raise ValueError(f"rope: rotary_dim {rotary_dim} must be even and <= head_dim {q.shape[-1]}")
    return impl("rope", q.device)(q, k, positions, rotary_dim, theta, mrope_section, mrope_interleaved)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim. x [T, D], weight/bias [D]."""
    return impl("layer_norm", x.device)(x, weight, bias, eps)


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU, exact ("none") or tanh-approximated ("tanh")."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: approximate={approximate!r}")
    return impl("gelu", x.device)(x, approximate)


def rotary_embed(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary over the whole head dim with given angles. x [T, H, D]; cos, sin [T, D]."""
    if cos.shape != (x.shape[0], x.shape[-1]) or sin.shape != cos.shape:
        raise ValueError(f"rotary_embed: x {tuple(x.shape)}, cos {tuple(cos.shape)}")
    return impl("rotary_embed", x.device)(x, cos, sin)
