"""Linear layers over dense or GPTQ-int8 weights, and the per-row low-rank delta (Clef rows)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qv.kernels.registry import impl


@dataclass
class GPTQWeight:
    """A GPTQ-int8 weight in qv's runtime layout (repacked once at load from the checkpoint's).

    qweight [K, N] uint8  - the integer codes, input-major like GPTQ's packed qweight
    scales  [G, N] fp     - per (group, output) scale, G = number of groups
    zeros   [G, N] fp | None - per (group, output) true zero point; None means symmetric (128)
    g_idx   [K] int32     - group of each input row (k // group_size unless desc_act)
    group_size: int       - rows per group (K for a single group); informational when desc_act
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    g_idx: torch.Tensor
    group_size: int

    @property
    def in_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def shape(self) -> tuple[int, int]:  # nn.Linear orientation [N, K]
        return (self.out_features, self.in_features)

    def to(self, device) -> "GPTQWeight":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return GPTQWeight(move(self.qweight), move(self.scales), move(self.zeros), move(self.g_idx), self.group_size)


def linear(x: torch.Tensor, weight: torch.Tensor | GPTQWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ bias). x [T, K]; weight dense [N, K] or GPTQWeight (K x N codes); bias [N]; y [T, N]."""
    k = weight.shape[1]
    if x.shape[-1] != k:
        raise ValueError(f"linear: x last dim {x.shape[-1]} != weight in_features {k}")
    return impl("linear", x.device)(x, weight, bias)


def lora_delta(y: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               scale: float) -> torch.Tensor:
    """y[rows] += (x[rows] A^T) B^T * scale, other rows untouched; returns y (possibly in place).

    y [T, N], x [T, K], rows [R] int64 (row indices), a [r, K], b [N, r].
    """
    if a.shape[1] != x.shape[-1] or b.shape[0] != y.shape[-1] or a.shape[0] != b.shape[1]:
        raise ValueError(f"lora_delta: x {tuple(x.shape)}, y {tuple(y.shape)}, a {tuple(a.shape)}, b {tuple(b.shape)}")
    return impl("lora_delta", x.device)(y, x, rows, a, b, scale)
