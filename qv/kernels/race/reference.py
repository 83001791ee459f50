"""The race's reference: PyTorch int64 and fp64 ops, bit-identical on every device (so every backend
runs it; see registry.TABLE)."""

from __future__ import annotations

import torch

_GOLDEN = 0x9E3779B97F4A7C15


def _to_signed(x: int) -> int:
    return x - (1 << 64) if x >= (1 << 63) else x


_C1 = _to_signed(0xBF58476D1CE4E5B9)
_C2 = _to_signed(0x94D049BB133111EB)
_G = _to_signed(_GOLDEN)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 tensors (wrapping multiply; logical shifts emulated)."""

    def srl(v: torch.Tensor, k: int) -> torch.Tensor:  # logical right shift on int64
        return (v >> k) & ((1 << (64 - k)) - 1)

    x = (x ^ srl(x, 30)) * _C1
    x = (x ^ srl(x, 27)) * _C2
    return x ^ srl(x, 31)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """u[r, t] in (0, 1) as fp64, a pure function of (seeds[r], positions[r], t)."""
    tok = torch.arange(vocab, dtype=torch.int64, device=seeds.device)
    key = _mix64(seeds[:, None] * _G + positions[:, None]) + tok[None, :] * _G
    bits = (_mix64(key) >> 11) & ((1 << 53) - 1)
    return (bits.double() + 0.5) / float(1 << 53)


def race(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Exponential race over unnormalised probabilities [R, V]: argmax p / E with E = -log(u), which is
    a sample of p / sum(p). seeds, positions [R] int64."""
    noise = uniform_noise(seeds, positions, probs.shape[-1])
    return (probs.double() / -torch.log(noise)).argmax(dim=-1)
