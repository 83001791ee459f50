"""Linear layers over dense or GPTQ-int8 weights, and qv's runtime layout of a GPTQ-int8 weight."""

from __future__ import annotations

from dataclasses import dataclass, field

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
    sequential: bool | None - whether g_idx is k // group_size; None until is_sequential() first checks
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    g_idx: torch.Tensor
    group_size: int
    sequential: bool | None = field(default=None, compare=False)

    @property
    def in_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def shape(self) -> tuple[int, int]:  # nn.Linear orientation [N, K]
        return (self.out_features, self.in_features)

    def is_sequential(self) -> bool:
        """Whether g_idx is k // group_size (no act-order): the kernels' fast paths need it. Checked once per
        weight (one host sync at first use) and kept in `sequential`."""
        if self.sequential is None:
            expect = torch.arange(self.in_features, device=self.g_idx.device, dtype=torch.int64) // self.group_size
            self.sequential = bool(torch.equal(self.g_idx.long(), expect))
        return self.sequential

    def to(self, device) -> "GPTQWeight":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return GPTQWeight(move(self.qweight), move(self.scales), move(self.zeros), move(self.g_idx), self.group_size)


def linear(x: torch.Tensor, weight: torch.Tensor | GPTQWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ bias). x [T, K]; weight dense [N, K] or GPTQWeight (K x N codes); bias [N]; y [T, N]."""
    k = weight.shape[1]
    if x.shape[-1] != k:
        raise ValueError(f"linear: x last dim {x.shape[-1]} != weight in_features {k}")
    return impl("linear", x.device)(x, weight, bias)
