"""grouped_delta against the reference: several slots of different ranks over a fused Linear's members
(some modules missing, two modules on one member as Clef's LoRA + deabl), rows of each slot scattered
through the batch, rows of no slot and empty slots untouched; the plain-rows form (every row slot 0)."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import BOUND, DEV, K, nan_empty, randn, run_reference, run_triton
from qv.kernels.grouped_delta import DeltaGroups
from qv.model.delta_bank import DeltaBank
from util import assert_close


def _bank(dtype, k, members, slots, aligned=False):
    """slots: per slot a list of (member, rank) modules; capacity for the largest (aligned: B capacities a multiple
    of 8, so with members of multiples of 8 the expand loads B 8 elements at once)."""
    cap_rows = max(sum(r for _, r in mods) for mods in slots) + 3
    cap_b = max(sum(r * members[m] for m, r in mods) for mods in slots) + (8 if aligned else 5)
    bank = DeltaBank(k, members, [cap_rows] * len(slots), [cap_b] * len(slots), dtype, DEV)
    for s, mods in enumerate(slots):
        bank.write(s, [(m, randn(r, k, dtype=dtype), randn(members[m], r, dtype=dtype), 0.5 + 0.25 * i)
                       for i, (m, r) in enumerate(mods)])
    return bank


def _groups(slot_of_row: list[int], num_slots: int) -> DeltaGroups:
    rows, starts = [], [0]
    for s in range(num_slots):
        rows += [i for i, x in enumerate(slot_of_row) if x == s]
        starts.append(len(rows))
    as_t = lambda v, dt: torch.tensor(v, dtype=dt, device=DEV)  # noqa: E731
    most = max(b - a for a, b in zip(starts, starts[1:]))
    return DeltaGroups(as_t(rows, torch.int64), as_t(starts, torch.int32), most)


def _run_sm70(fn, *args):
    with K.backend("sm70"), nan_empty():
        return fn(*args)


def _check(dtype, bank, t, slot_of_row, num_slots, run=run_triton):
    y = randn(t, sum(bank.member_sizes), dtype=dtype)
    x = randn(t, bank.in_features, dtype=dtype)
    g = _groups(slot_of_row, num_slots)
    ref = run_reference(K.grouped_delta, y.clone(), x, g.rows, g.slot_start, g.max_rows, bank.view(DEV))
    out = run(K.grouped_delta, y.clone(), x, g.rows, g.slot_start, g.max_rows, bank.view(DEV))
    assert_close("grouped_delta", out, ref, BOUND[dtype])
    untouched = torch.tensor([s < 0 or s >= num_slots for s in slot_of_row], device=DEV)
    assert torch.equal(out[untouched], y[untouched]), "a row outside the groups changed"
    assert not torch.equal(ref[~untouched], y[~untouched]), "the deltas did nothing (a test that cannot fail)"
    return out


@pytest.mark.parametrize("backend", ["triton", "sm70"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_delta_slots_and_members(dtype, backend):
    """(sm70: the kernels without tl.dot)"""
    members = [37, 9, 20]  # a fused Linear (q | k | v-like), odd widths
    slots = [[(0, 5), (1, 5), (2, 5), (0, 1), (1, 1), (2, 1)],  # Clef-like: a LoRA plus a rank-1 deabl
             [(1, 3)],  # one projection only
             [],  # a free slot
             [(2, 17), (0, 17)]]  # rank past a block, members given out of order
    bank = _bank(dtype, 45, members, slots)
    slot_of_row = [0, 0, 1, -1, 3, 3, 3, 0, 2, -1, 1, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
    _check(dtype, bank, len(slot_of_row), slot_of_row, 4, run_triton if backend == "triton" else _run_sm70)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_delta_fewer_groups_than_slots(dtype):
    """A step may name fewer slots than the bank holds (slot_start over the first ones)."""
    bank = _bank(dtype, 24, [33], [[(0, 2)], [(0, 4)], [(0, 6)]])
    _check(dtype, bank, 7, [1, -1, 0, 1, 1, -1, 0], 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_delta_many_rows(dtype):
    """A prompt chunk's worth of rows in a slot (configs.MANY_ROWS on): the large blocks."""
    bank = _bank(dtype, 40, [70, 12], [[(0, 40), (1, 40), (0, 1)], [(1, 9)], [(0, 70)]])
    gen = torch.Generator().manual_seed(7)
    slot_of_row = (torch.randint(-1, 3, (330,), generator=gen)).tolist()
    slot_of_row[:140] = [0] * 140  # one slot past MANY_ROWS whatever the draw
    _check(dtype, bank, len(slot_of_row), slot_of_row, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [130, 150])
def test_grouped_delta_shrink_split_over_k(dtype, k):
    """Few rows a slot and K past one block: the shrink splits K over programs (configs.shrink_splits; two parts
    under the interpreter, the last one short) whose partial t the expand sums."""
    from qv.kernels.grouped_delta.configs import FEW, shrink_splits

    assert shrink_splits(9, k, FEW[2], torch.device("cpu")) == 2
    bank = _bank(dtype, k, [40, 24], [[(0, 7), (1, 7), (0, 1)], [(1, 33)]])
    _check(dtype, bank, 12, [0, 1, -1, 0, 0, 1, 1, 0, -1, 1, 0, 0], 2)


@pytest.mark.parametrize("aligned", [False, True])
def test_grouped_delta_aligned_bank(aligned):
    """Members and B capacities of multiples of 8: the expand takes the bank's b_align (8) as a load-width hint; the
    same slots with a 5-element slack (b_align 1) take none. Both against the reference."""
    bank = _bank(torch.bfloat16, 32, [48, 16], [[(0, 9), (1, 9), (0, 1)], [(1, 3)]], aligned=aligned)
    assert bank.b_align == (8 if aligned else 1)
    _check(torch.bfloat16, bank, 11, [0, 1, -1, 0, 0, 1, 0, -1, 0, 0, 1], 2)


def test_b_align_divides_every_offset_column_and_width():
    """b_align is a promise the expand kernel relies on (a wrong one reads misaligned memory): over random members,
    capacities and slot contents, it divides every rank row's b_off, col and width."""
    gen = torch.Generator().manual_seed(3)
    for _ in range(40):
        pick = lambda *choices: choices[int(torch.randint(len(choices), (1,), generator=gen))]  # noqa: E731
        members = [pick(8, 16, 24, 40, 12, 6, 33) for _ in range(pick(1, 2, 3))]
        slots = [[(m, pick(1, 3, 8)) for m in range(len(members)) if pick(True, False)] for _ in range(pick(1, 2, 3))]
        slots = [mods or [(0, 1)] for mods in slots]
        bank = _bank(torch.float32, 8, members, slots, aligned=pick(True, False))
        rows = int(bank.row_base[-1])
        for t in (bank.b_off[:rows], bank.col[:rows], bank.width[:rows]):
            assert (t.cpu() % bank.b_align == 0).all(), (members, slots, bank.b_align)


def test_grouped_delta_plain_rows_run_slot_zero():
    bank = _bank(torch.float32, 24, [19, 6], [[(0, 3), (1, 2)], [(1, 4)]])
    y, x = randn(9, 25), randn(9, 24)
    rows = torch.tensor([5, 0, 7], device=DEV)
    g = _groups([0 if i in (5, 0, 7) else -1 for i in range(9)], 1)
    ref = run_reference(K.grouped_delta, y.clone(), x, g.rows, g.slot_start, g.max_rows, bank.view(DEV))
    out = run_triton(K.grouped_delta, y.clone(), x, rows, None, 3, bank.view(DEV))
    assert_close("grouped_delta", out, ref, BOUND[torch.float32])


def test_bank_rewrite_and_refusals():
    bank = _bank(torch.float32, 8, [5, 4], [[(0, 2)], [(1, 3)]])
    with pytest.raises(ValueError, match="need"):
        bank.write(1, [(0, randn(30, 8), randn(5, 30), 1.0)])
    with pytest.raises(ValueError, match="outputs there"):
        bank.write(1, [(0, randn(2, 8), randn(4, 2), 1.0)])
    bank.clear(0)
    y, x = randn(3, 9), randn(3, 8)
    out = run_reference(K.grouped_delta, y.clone(), x, torch.arange(3, device=DEV), None, 3, bank.view(DEV))
    assert torch.equal(out, y)


@pytest.mark.gpu
@pytest.mark.parametrize("rows_per_slot", [1, 700])
def test_grouped_delta_real_shapes(rows_per_slot):
    """27B gate_up (two members of 17408) with Clef's rank 256 + deabl and two rank-64 adapters."""
    members = [17408, 17408]
    slots = [[(0, 256), (1, 256), (0, 1), (1, 1)], [(0, 64), (1, 64)], [(1, 64)]]
    bank = _bank(torch.bfloat16, 5120, members, slots, aligned=True)
    assert bank.b_align == 8
    slot_of_row = [i % 4 - 1 for i in range(4 * rows_per_slot)]
    _check(torch.bfloat16, bank, len(slot_of_row), slot_of_row, 3)
