"""Sampling by an exponential race over counter-based random numbers: a uniform per (seed, position,
token) from a 64-bit hash (splitmix64's finalizer), so a seeded request draws the same token whatever
batch it is in, on any device, with no generator state and no host sync. uniform_noise is the same
hash for verification's acceptance draws (qv/spec/verify.py)."""

from __future__ import annotations

import torch

from qv.kernels.race.reference import uniform_noise  # noqa: F401  (verification's draws share the hash)
from qv.kernels.registry import impl


def race(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """probs [R, V] unnormalised probabilities; seeds, positions [R] int64. Returns [R] int64: argmax
    p / E with E = -log(u), u = uniform_noise(seeds, positions, V): a sample of p / sum(p)."""
    if probs.dim() != 2 or seeds.shape != (probs.shape[0],) or positions.shape != seeds.shape:
        raise ValueError(f"race: probs {tuple(probs.shape)}, seeds {tuple(seeds.shape)}, "
                         f"positions {tuple(positions.shape)}")
    return impl("race", probs.device)(probs, seeds, positions)
