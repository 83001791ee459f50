"""A step's outputs travel as one typed message: StepOutputs.pack and unpack walk one field list, so
every part comes back where it went, for every combination of parts a step can have."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from qv.engine.step_outputs import OutputShape, StepOutputs


def _filled(shape: OutputShape, gen: torch.Generator) -> StepOutputs:
    o = StepOutputs()
    for name, rows, cols, is_float in StepOutputs.parts(shape):
        size = (rows, cols) if cols else (rows,)
        t = torch.randn(size, generator=gen, dtype=torch.float64) if is_float else torch.randint(
            0, 1 << 40, size, generator=gen)
        setattr(o, name, t)
    return o


@pytest.mark.parametrize("samplers,verified,sample_top,verify_top,draft_k",
                         [c for c in itertools.product((0, 3), (0, 2), (-1, 0, 4), (-1, 0, 2), (0, 3)) if c[0] or c[1]])
def test_pack_then_unpack_is_the_identity(samplers, verified, sample_top, verify_top, draft_k):
    shape = OutputShape(samplers=samplers, verified=verified, k1=4, sample_top=sample_top, verify_top=verify_top,
                        draft_k=draft_k)
    sent = _filled(shape, torch.Generator().manual_seed(samplers * 100 + verified * 10 + draft_k))
    packed = sent.pack(shape, torch.device("cpu"))
    assert packed.dtype == torch.int64
    for host in (packed.numpy(), packed):  # the driver's host copy, and a tensor-parallel worker's
        got = StepOutputs.unpack(host, shape)
        for name, rows, cols, is_float in StepOutputs.parts(shape):
            a, b = getattr(sent, name), torch.as_tensor(np.asarray(getattr(got, name)))
            assert b.shape == a.shape and torch.equal(b, a), name
        absent = {f for f in vars(got)} - {name for name, *_ in StepOutputs.parts(shape)}
        assert all(getattr(got, f) is None for f in absent)


def test_a_missing_part_or_a_wrong_size_is_a_bug_not_garbage():
    shape = OutputShape(samplers=2, verified=1, k1=3)
    o = StepOutputs(sampled=torch.tensor([1, 2]), verified=torch.tensor([[1, 2, 3]]))
    with pytest.raises(RuntimeError, match="accepted has None values"):
        o.pack(shape, torch.device("cpu"))
    o.accepted = torch.tensor([1, 2])
    with pytest.raises(RuntimeError, match="accepted has 2 values, not 1"):
        o.pack(shape, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="packed step outputs"):
        StepOutputs.unpack(np.zeros(9, dtype=np.int64), shape)
