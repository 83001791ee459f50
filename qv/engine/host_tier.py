"""The optional second tier of the prefix cache (`kv_offload_bytes`): KV blocks and GDN snapshots
evicted from the device are copied to pinned host memory, and a later hit copies them back.

Both kinds are keyed by the same digests as on the device (blocks also keep their key, so the
content check holds here too) and evicted LRU. Copies are asynchronous and ordered on the current
stream: an offload is enqueued before the forward that overwrites the device block, and a
restore before the forward that reads it, so no host sync is needed. Entries a hit is restoring
right now are pinned so that the evictions the restore itself causes cannot drop them. With tensor
parallelism every rank keeps its own host rows of its shard: the driver's copies are replayed there.
"""

from __future__ import annotations

from collections import OrderedDict

from qv.engine.state_pool import RowCopies, empty_like_rows


class _Store:
    """Rows of host tensors shaped like one row of the device pool `like` each (registered in
    `copies` as `name`), with an LRU index by digest."""

    def __init__(self, copies: RowCopies, name: str, like: str, rows: int, pin: bool):
        self.copies, self.name = copies, name
        self.tensors = copies.add(name, empty_like_rows(copies.pools[like], rows, "cpu", pin))
        self.index: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self.keys: dict[bytes, tuple | None] = {}
        self.free = list(range(rows - 1, -1, -1))
        self.pinned: set[bytes] = set()

    def find(self, digest: bytes, key: tuple | None = None) -> bool:
        return digest in self.index and self.keys[digest] == key

    def save(self, src: str, src_row: int, digest: bytes, key: tuple | None) -> bool:
        if digest in self.index:
            self.index.move_to_end(digest)
            return False
        row = self._take()
        if row is None:
            return False
        self.copies.copy(self.name, [row], src, [src_row])
        self.index[digest], self.keys[digest] = row, key
        return True

    def restore(self, digest: bytes, dst: str, dst_row: int) -> None:
        row = self.index[digest]
        self.index.move_to_end(digest)
        self.copies.copy(dst, [dst_row], self.name, [row])

    def _take(self) -> int | None:
        if self.free:
            return self.free.pop()
        victim = next((d for d in self.index if d not in self.pinned), None)
        if victim is None:
            return None
        self.keys.pop(victim)
        return self.index.pop(victim)

    def reset(self) -> None:
        self.free += list(self.index.values())
        self.index.clear()
        self.keys.clear()
        self.pinned.clear()


class HostTier:
    """Host rows beside the device pools of `copies` ("block", "snapshot", "slot"), added to it as
    "host_block" and "host_snapshot"."""

    def __init__(self, copies: RowCopies, num_blocks: int, num_snapshots: int, pin: bool):
        self.blocks = _Store(copies, "host_block", "block", num_blocks, pin)
        self.snapshots = _Store(copies, "host_snapshot", "slot", num_snapshots, pin)
        self.num_blocks, self.num_snapshots = num_blocks, num_snapshots
        self.blocks_offloaded = self.snapshots_offloaded = 0
        self.blocks_restored = self.snapshots_restored = 0

    # -- device -> host (called from the device pools' eviction hooks) ---------------------------
    def save_block(self, b: int, digest: bytes, key: tuple) -> None:
        self.blocks_offloaded += self.blocks.save("block", b, digest, key)

    def save_snapshot(self, row: int, digest: bytes) -> None:
        self.snapshots_offloaded += self.snapshots.save("snapshot", row, digest, None)

    # -- lookups and host -> device -------------------------------------------------------------
    def has_block(self, digest: bytes, key: tuple) -> bool:
        return self.blocks.find(digest, key)

    def has_snapshot(self, digest: bytes) -> bool:
        return self.snapshots.find(digest)

    def pin(self, digests: list[bytes]) -> None:
        self.blocks.pinned.update(digests)
        self.snapshots.pinned.update(digests)

    def unpin(self) -> None:
        self.blocks.pinned.clear()
        self.snapshots.pinned.clear()

    def restore_block(self, digest: bytes, b: int) -> None:
        self.blocks.restore(digest, "block", b)
        self.blocks_restored += 1

    def restore_snapshot(self, digest: bytes, slot: int) -> None:
        self.snapshots.restore(digest, "slot", slot)
        self.snapshots_restored += 1

    def reset(self) -> None:
        self.blocks.reset()
        self.snapshots.reset()
