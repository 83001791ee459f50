"""fp32 GELU: the oracle of gelu."""

from __future__ import annotations

import torch.nn.functional as F


def gelu(x, approximate="none"):
    return F.gelu(x.float(), approximate=approximate).to(x.dtype)
