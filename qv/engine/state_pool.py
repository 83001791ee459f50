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

Every row copy the prefix cache makes goes through one RowCopies, between pools named by role, so
that with tensor parallelism the driver can log them (names and rows) and each worker replay them on
its own shard's pools, in the driver's order (qv/engine/tensor_parallel.py).
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


StateOp = tuple[str, tuple[int, ...], str, tuple[int, ...]]  # (dst pool, dst rows, src pool, src rows)


class RowCopies:
    """The prefix cache's state pools by name ("slot": GDN state slots, "block": KV blocks,
    "snapshot": device GDN snapshots, "host_block" / "host_snapshot": the host tier) and every copy
    of rows between them. After `start_log` each copy is also logged, for tensor-parallel workers."""

    def __init__(self):
        self.pools: dict[str, list[torch.Tensor]] = {}
        self._log: list[StateOp] | None = None

    def add(self, name: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        self.pools[name] = tensors
        return tensors

    def copy(self, dst: str, dst_rows: list[int], src: str, src_rows: list[int]) -> None:
        copy_rows(self.pools[dst], dst_rows, self.pools[src], src_rows)
        if self._log is not None and dst_rows:
            self._log.append((dst, tuple(dst_rows), src, tuple(src_rows)))

    def start_log(self) -> None:
        self._log = []

    def take_log(self) -> tuple[StateOp, ...]:
        """The copies made since the last call, in order (empty when not logging)."""
        if not self._log:
            return ()
        ops, self._log = tuple(self._log), []
        return ops

    def replay(self, ops: tuple[StateOp, ...]) -> None:
        """Make another rank's logged copies on these pools (the same names and rows, this rank's shard)."""
        for dst, dst_rows, src, src_rows in ops:
            copy_rows(self.pools[dst], list(dst_rows), self.pools[src], list(src_rows))


class GDNSnapshotPool:
    """Snapshots keyed by the digest of the last block before their boundary (which names the whole
    prefix, salt and media included). Nobody holds a snapshot: a hit copies it into the sequence's
    slot, so eviction is plain LRU; `on_evict(row, digest)` lets a host tier keep it."""

    def __init__(self, cache: HybridCache, num_snapshots: int, copies: RowCopies | None = None):
        self.num_snapshots = num_snapshots
        self.copies = copies or RowCopies()
        self.slots = self.copies.add("slot", slot_tensors(cache))
        device = self.slots[0].device if self.slots else "cpu"
        self.tensors = self.copies.add("snapshot", empty_like_rows(self.slots, num_snapshots, device))
        self.index: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self.free = list(range(num_snapshots - 1, -1, -1))
        self.on_evict: Callable[[int, bytes], None] | None = None
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
        self.copies.copy("snapshot", rows, "slot", [slot for _, slot in todo])
        for row, (digest, _) in zip(rows, todo):
            self.index[digest] = row
        self.num_saved += len(todo)

    def load(self, digest: bytes, slot: int) -> None:
        row = self.index[digest]
        self.index.move_to_end(digest)
        self.copies.copy("slot", [slot], "snapshot", [row])

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
            self.on_evict(row, digest)
        return row
