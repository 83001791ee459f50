"""Gated DeltaNet state slots (one per running sequence, fixed size whatever its length) and the
snapshots of that state that let a request resume from a cached prefix.

The slot tensors live in qv.model.cache.HybridCache (per GDN layer: conv state [slots, W-1, C] =
the last W-1 pre-conv inputs, and the recurrent state [slots, Hv, dk, dv], k-major as in
transformers; int16 storage keeps a per-(slot, head, column) fp32 scale beside it). A
sequence admitted with no computed tokens starts from zero state (`has_initial_state` false),
so a freed slot never needs clearing.

A snapshot is a copy of one slot's tensors taken when the sequence's computed tokens sit exactly
on a snapshot boundary, stored in the slot's own dtype with its int16 scales (so saving and
restoring are exact copies, never a requantization).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from qv.model.cache import HybridCache


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


def slot_tensors(cache: HybridCache) -> list[torch.Tensor]:
    """Every tensor that makes up one GDN state slot (row i of each belongs to slot i)."""
    out = []
    for i in sorted(cache.gdn):
        st = cache.gdn[i]
        out += [st.conv, st.ssm] + ([st.ssm_scale] if st.ssm_scale is not None else [])
    return out


def block_tensors(cache: HybridCache) -> list[torch.Tensor]:
    """Every tensor that makes up one KV block (row b of each belongs to block b)."""
    out = []
    for i in sorted(cache.kv):
        kv = cache.kv[i]
        out += [kv.k, kv.v] + ([kv.k_scale, kv.v_scale] if kv.k_scale is not None else [])
    return out


def empty_like_rows(tensors: list[torch.Tensor], rows: int, device, pin: bool = False) -> list[torch.Tensor]:
    return [torch.zeros((rows,) + tuple(t.shape[1:]), dtype=t.dtype, device=device, pin_memory=pin)
            for t in tensors]


def copy_rows(dst: list[torch.Tensor], dst_rows: list[int], src: list[torch.Tensor], src_rows: list[int]) -> None:
    """dst[t][dst_rows[j]] = src[t][src_rows[j]] for every tensor t. On one device this is one gather
    and one scatter per tensor; across devices (host tier) row copies, asynchronous from and to
    pinned memory and ordered on the current stream before the next forward."""
    if not dst_rows:
        return
    if dst and dst[0].device == src[0].device:
        d = torch.tensor(dst_rows, dtype=torch.int64, device=dst[0].device)
        s = torch.tensor(src_rows, dtype=torch.int64, device=src[0].device)
        for a, b in zip(dst, src):
            a.index_copy_(0, d, b.index_select(0, s))
        return
    for a, b in zip(dst, src):
        for i, j in zip(dst_rows, src_rows):
            a[i].copy_(b[j], non_blocking=True)


class GDNSnapshotPool:
    """Snapshots keyed by the digest of the last block before their boundary (which names the whole
    prefix, salt and media included). Nobody holds a snapshot: a hit copies it into the sequence's
    slot, so eviction is plain LRU; `on_evict` lets a host tier keep it."""

    def __init__(self, cache: HybridCache, num_snapshots: int):
        self.num_snapshots = num_snapshots
        self.slots = slot_tensors(cache)
        device = self.slots[0].device if self.slots else "cpu"
        self.tensors = empty_like_rows(self.slots, num_snapshots, device)
        self.index: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self.free = list(range(num_snapshots - 1, -1, -1))
        self.on_evict: Callable[[list[torch.Tensor], int, bytes], None] | None = None
        self.num_saved = 0

    def __contains__(self, digest: bytes) -> bool:
        return digest in self.index

    def __len__(self) -> int:
        return len(self.index)

    def save(self, pairs: list[tuple[int, bytes]]) -> None:
        """Copy slot -> new snapshot for each (slot, digest), evicting the least recently used."""
        new: dict[bytes, int] = {}
        for slot, digest in pairs:
            if digest not in self.index:
                new.setdefault(digest, slot)
        todo = list(new.items())[:self.num_snapshots]
        if not todo:
            return
        rows = [self._take() for _ in todo]
        copy_rows(self.tensors, rows, self.slots, [slot for _, slot in todo])
        for row, (digest, _) in zip(rows, todo):
            self.index[digest] = row
        self.num_saved += len(todo)

    def load(self, digest: bytes, slot: int) -> None:
        row = self.index[digest]
        self.index.move_to_end(digest)
        copy_rows(self.slots, [slot], self.tensors, [row])

    def drop(self, digest: bytes) -> None:
        row = self.index.pop(digest, None)
        if row is not None:
            self.free.append(row)

    def reset(self) -> None:
        self.free += list(self.index.values())
        self.index.clear()

    def _take(self) -> int:
        if self.free:
            return self.free.pop()
        digest, row = self.index.popitem(last=False)
        if self.on_evict is not None:
            self.on_evict(self.tensors, row, digest)
        return row
