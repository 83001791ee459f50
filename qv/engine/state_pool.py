"""Gated DeltaNet state slots: one per running sequence, fixed size whatever its length.

The tensors live in qv.model.cache.HybridCache (per GDN layer: conv state [slots, W-1, C] =
the last W-1 pre-conv inputs, and the recurrent state [slots, Hv, dk, dv], k-major as in
transformers; int16 storage keeps a per-(slot, head, column) fp32 scale beside it). A
sequence admitted with no computed tokens starts from zero state (`has_initial_state` false),
so a freed slot never needs clearing.
"""

from __future__ import annotations


class GDNStatePool:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"the GDN state pool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self.free)

    def acquire(self) -> int:
        return self.free.pop()

    def release(self, slot: int) -> None:
        if slot >= 0:
            self.free.append(slot)
