"""fp32 sigmoid gate: the oracle of sigmoid_mul."""

from __future__ import annotations

import torch


def sigmoid_mul(x, gate):
    return (x.float() * torch.sigmoid(gate.float())).to(x.dtype)
