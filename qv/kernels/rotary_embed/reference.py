"""fp32 full-dim rotary with given cos/sin: the oracle of rotary_embed."""

from __future__ import annotations

from qv.kernels.rope.reference import rotate


def rotary_embed(x, cos, sin):
    return rotate(x, cos.float()[:, None, :], sin.float()[:, None, :], x.shape[-1])
