"""The paged block pool of the full-attention layers: which KV blocks are free, which sequence
holds which, and (prefix caching) which full blocks hold a known prefix. (The tensors themselves
are qv.model.cache.HybridCache; int8 KV is a property of those tensors, not of this bookkeeping.)

A full block is registered under a digest that names the whole prefix up to its end (see
qv/engine/prefix_cache.py) together with its key (parent digest, token ids, media hashes), and
lookups compare that key, so a digest collision is a miss, never a wrong hit. Blocks are
reference counted: a hit shares a block with whoever else holds it. A released block that still
holds a digest goes to an LRU of cached-free blocks and stays findable; allocation takes
never-cached free blocks first and only then evicts the least recently used cached one (the
`on_evict` hook lets a host tier copy it out first).

Isolated sequences (Clef rows) may not evict cached blocks below `reserve_blocks`, so a burst of
records cannot flush chat prefixes; they can therefore hold at most num_blocks - reserve_blocks.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable

NO_CACHE = b""  # digest of a held block that must not become cached (its prefix was reset away)


class KVBlockPool:
    def __init__(self, num_blocks: int, block_size: int, reserve_blocks: int = 0):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.reserve_blocks = min(reserve_blocks, num_blocks - 1)
        self.free: deque[int] = deque(range(num_blocks))  # free and holding no prefix
        self.cached_free: OrderedDict[int, None] = OrderedDict()  # free but findable, least recent first
        self.ref_counts = [0] * num_blocks
        self.block_digest: list[bytes | None] = [None] * num_blocks
        self.block_key: list[tuple | None] = [None] * num_blocks
        self.digest_to_block: dict[bytes, int] = {}
        self.on_evict: Callable[[int, bytes, tuple], None] | None = None
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        return len(self.free) + len(self.cached_free)

    @property
    def num_cached(self) -> int:
        return len(self.digest_to_block)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_available(self, isolated: bool = False) -> int:
        """Blocks a sequence may take now; isolated ones leave `reserve_blocks` cached blocks alone."""
        if not isolated:
            return self.num_free
        return len(self.free) + max(0, len(self.cached_free) - self.reserve_blocks)

    def capacity(self, isolated: bool = False) -> int:
        """Most blocks one sequence can ever hold (what decides 'too large for the cache')."""
        return self.num_blocks - (self.reserve_blocks if isolated else 0)

    def can_grow(self, held: int, num_tokens: int, isolated: bool = False) -> bool:
        """Whether a sequence holding `held` blocks can cover `num_tokens` tokens."""
        return self.blocks_for(num_tokens) - held <= self.num_available(isolated)

    def grow(self, block_ids: list[int], num_tokens: int) -> None:
        """Append blocks to `block_ids` until it covers `num_tokens` tokens (caller checked can_grow)."""
        for _ in range(self.blocks_for(num_tokens) - len(block_ids)):
            block_ids.append(self.take())

    def take(self) -> int:
        """One block for writing: a never-cached one if any, else evict the least recently used."""
        if self.free:
            b = self.free.popleft()
        else:
            b, _ = self.cached_free.popitem(last=False)
            self._evict(b)
        self.ref_counts[b] = 1
        return b

    def release(self, block_ids: list[int]) -> None:
        # tail blocks first, so they are evicted before the prefix blocks more requests share
        for b in reversed(block_ids):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                if self.block_digest[b]:
                    self.cached_free[b] = None
                else:
                    self.block_digest[b] = self.block_key[b] = None
                    self.free.append(b)
        block_ids.clear()

    # -- prefix cache --------------------------------------------------------------------------
    def lookup(self, digest: bytes, key: tuple) -> int | None:
        b = self.digest_to_block.get(digest)
        return b if b is not None and self.block_key[b] == key else None

    def touch(self, b: int) -> None:
        """A hit: share block b (reviving it from the cached-free LRU if nobody held it)."""
        if self.ref_counts[b] == 0:
            del self.cached_free[b]
        self.ref_counts[b] += 1

    def register(self, b: int, digest: bytes, key: tuple) -> bool:
        """Make held block b findable under `digest`; False if that digest is already cached."""
        if digest in self.digest_to_block or self.block_digest[b] is not None:
            return False
        self.block_digest[b], self.block_key[b] = digest, key
        self.digest_to_block[digest] = b
        return True

    def mark_uncacheable(self, b: int) -> None:
        self.block_digest[b], self.block_key[b] = NO_CACHE, None

    def reset_cache(self) -> None:
        """Forget every prefix: cached-free blocks become plain free, held ones never get cached."""
        for b in self.cached_free:
            self.block_digest[b] = self.block_key[b] = None
            self.free.append(b)
        self.cached_free.clear()
        self.digest_to_block.clear()
        for b in range(self.num_blocks):
            if self.ref_counts[b]:
                self.mark_uncacheable(b)

    def _evict(self, b: int) -> None:
        digest, key = self.block_digest[b], self.block_key[b]
        del self.digest_to_block[digest]
        self.block_digest[b] = self.block_key[b] = None
        self.num_evictions += 1
        if self.on_evict is not None:
            self.on_evict(b, digest, key)
