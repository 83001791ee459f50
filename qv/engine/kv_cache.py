"""The paged block pool of the full-attention layers: which KV blocks are free and which
sequence holds which. (The tensors themselves are qv.model.cache.HybridCache; int8 KV is a
property of those tensors, not of this bookkeeping.)"""

from __future__ import annotations

from collections import deque


class KVBlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_grow(self, held: int, num_tokens: int) -> bool:
        """Whether a sequence holding `held` blocks can cover `num_tokens` tokens."""
        return self.blocks_for(num_tokens) - held <= len(self.free)

    def grow(self, block_ids: list[int], num_tokens: int) -> None:
        """Append blocks to `block_ids` until it covers `num_tokens` tokens (caller checked can_grow)."""
        need = self.blocks_for(num_tokens) - len(block_ids)
        for _ in range(need):
            b = self.free.popleft()
            self.ref_counts[b] = 1
            block_ids.append(b)

    def release(self, block_ids: list[int]) -> None:
        for b in block_ids:
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free.append(b)
        block_ids.clear()
