"""The optional second tier of the prefix cache (`kv_offload_bytes`): KV blocks and GDN snapshots
evicted from the device are copied to pinned host memory, and a later hit copies them back.

Both kinds are keyed by the same digests as on the device (blocks also keep their key, so the
content check holds here too) and evicted LRU. Copies are asynchronous and ordered on the current
stream: an offload is enqueued before the forward that overwrites the device block, and a
restore before the forward that reads it, so no host sync is needed. Entries a hit is restoring
right now are pinned so that the evictions the restore itself causes cannot drop them.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from qv.engine.state_pool import copy_rows, empty_like_rows


class _Store:
    """Rows of host tensors shaped like one device row each, with an LRU index by digest."""

    def __init__(self, like: list[torch.Tensor], rows: int, pin: bool):
        self.tensors = empty_like_rows(like, rows, "cpu", pin)
        self.index: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self.keys: dict[bytes, tuple | None] = {}
        self.free = list(range(rows - 1, -1, -1))
        self.pinned: set[bytes] = set()

    def find(self, digest: bytes, key: tuple | None = None) -> bool:
        return digest in self.index and self.keys[digest] == key

    def save(self, src: list[torch.Tensor], src_row: int, digest: bytes, key: tuple | None) -> bool:
        if digest in self.index:
            self.index.move_to_end(digest)
            return False
        row = self._take()
        if row is None:
            return False
        copy_rows(self.tensors, [row], src, [src_row])
        self.index[digest], self.keys[digest] = row, key
        return True

    def restore(self, digest: bytes, dst: list[torch.Tensor], dst_row: int) -> None:
        row = self.index[digest]
        self.index.move_to_end(digest)
        copy_rows(dst, [dst_row], self.tensors, [row])

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
    def __init__(self, block_like: list[torch.Tensor], snapshot_like: list[torch.Tensor], num_blocks: int,
                 num_snapshots: int, pin: bool):
        self.blocks = _Store(block_like, num_blocks, pin)
        self.snapshots = _Store(snapshot_like, num_snapshots, pin)
        self.num_blocks, self.num_snapshots = num_blocks, num_snapshots
        self.blocks_offloaded = self.snapshots_offloaded = 0
        self.blocks_restored = self.snapshots_restored = 0

    # -- device -> host (called from the device pools' eviction hooks) ---------------------------
    def save_block(self, device_blocks: list[torch.Tensor], b: int, digest: bytes, key: tuple) -> None:
        self.blocks_offloaded += self.blocks.save(device_blocks, b, digest, key)

    def save_snapshot(self, device_snapshots: list[torch.Tensor], row: int, digest: bytes) -> None:
        self.snapshots_offloaded += self.snapshots.save(device_snapshots, row, digest, None)

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

    def restore_block(self, digest: bytes, device_blocks: list[torch.Tensor], b: int) -> None:
        self.blocks.restore(digest, device_blocks, b)
        self.blocks_restored += 1

    def restore_snapshot(self, digest: bytes, device_slots: list[torch.Tensor], slot: int) -> None:
        self.snapshots.restore(digest, device_slots, slot)
        self.snapshots_restored += 1

    def reset(self) -> None:
        self.blocks.reset()
        self.snapshots.reset()
