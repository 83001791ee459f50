"""race (sampling's exponential race) against an independent statement: splitmix64's finalizer in
Python integers for the noise, argmax p / -log(u) in Python floats for the draw; and every backend's
entry draws the same tokens."""

from __future__ import annotations

import math

import pytest
import torch

from kernel_cases import DEV, K, run_reference, run_triton
from qv.kernels.race import uniform_noise

MASK = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


def _mix64(x: int) -> int:
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def _uniform(seed: int, position: int, token: int) -> float:
    key = (_mix64((seed * GOLDEN + position) & MASK) + token * GOLDEN) & MASK
    return ((_mix64(key) >> 11) + 0.5) / float(1 << 53)


def test_noise_is_splitmix64_of_seed_position_token():
    seeds = torch.tensor([0, 7, -3, (1 << 62) + 12345], dtype=torch.int64, device=DEV)
    positions = torch.tensor([0, 1, 999, 5], dtype=torch.int64, device=DEV)
    got = uniform_noise(seeds, positions, 6).cpu()
    for r in range(4):
        for t in range(6):
            assert got[r, t].item() == _uniform(int(seeds[r]) & MASK, int(positions[r]), t), (r, t)


@pytest.mark.parametrize("rows,vocab", [(5, 7), (3, 300)])
def test_race_is_the_argmax_of_p_over_minus_log_u(rows, vocab):
    probs = torch.rand(rows, vocab, device=DEV) * (torch.rand(rows, vocab, device=DEV) > 0.3)
    seeds = torch.randint(0, 1 << 40, (rows,), device=DEV)
    positions = torch.randint(0, 1000, (rows,), device=DEV)
    ours = run_triton(K.race, probs, seeds, positions)
    assert torch.equal(ours, run_reference(K.race, probs, seeds, positions))
    for r in range(rows):
        keys = [float(probs[r, t]) / -math.log(_uniform(int(seeds[r]), int(positions[r]), t)) for t in range(vocab)]
        assert int(ours[r]) == max(range(vocab), key=keys.__getitem__), r


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="race: probs"):
        K.race(torch.rand(2, 3), torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64))
