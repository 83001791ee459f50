"""Prefix caching for the hybrid model: a request resumes from the longest prefix whose attention
KV blocks AND Gated DeltaNet state are both cached.

- Full blocks are named by a chained digest: blake2b-128 of (parent digest, token ids, media hashes
  in the block), rooted at the cache salt, so one digest names a whole prefix. Blocks are
  registered (qv/engine/kv_cache.py) after the step that fills them, prompt and output alike; a
  freshly computed block whose prefix is cached already is swapped for the cached one (dedup).
- GDN state exists only per sequence, at its current position, so it is snapshotted when a
  sequence's computed tokens land exactly on a multiple of `interval` (a multiple of block_size).
  `clip` ends a prefill chunk at such a boundary when its snapshot is still missing, so the state
  AT the boundary exists; decode crosses boundaries one token at a time.
- On admission `match` walks the digest chain (device blocks, then host blocks), and the hit is
  the longest run of blocks ending on a boundary that has a snapshot, and always short of the
  last token (which is recomputed, for its logits). `admit` shares the blocks, copies the snapshot
  into the sequence's slot and starts it at num_computed_tokens = that prefix.
- Clef rows (cache_salt "clef:...") run with other effective weights: they never read, register
  or snapshot, and the block pool keeps them from evicting a reserved share of cached blocks.
- With a host tier (qv/engine/host_tier.py), blocks and snapshots evicted from the device are
  copied to pinned host memory and restored on a hit.
- Every copy of device state (snapshot save and load, host offload and restore) goes through
  `copies` (qv/engine/state_pool.py RowCopies). With tensor parallelism the driver logs them and each
  worker replays them on its own shard's pools (`replica_pools`) before the next step's forward; the
  bookkeeping here (digests, LRU, reference counts) runs on the driver only.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass

from qv.config import ConfigError
from qv.engine.host_tier import HostTier
from qv.engine.kv_cache import NO_CACHE, KVBlockPool
from qv.engine.prompt_logprobs import cacheable_tokens
from qv.engine.sequence import Sequence
from qv.engine.state_pool import GDNSnapshotPool, RowCopies, block_tensors
from qv.engine.step_feature import StepFeature
from qv.model.cache import HybridCache

AUTO_INTERVAL_BLOCKS = 64  # the automatic snapshot spacing is a multiple of this many blocks
AUTO_SNAPSHOT_RATIO = 0.5  # ...the smallest at which snapshots cost <= this share of KV bytes per token
CLEF_SALT_PREFIX = "clef:"


def is_isolated(seq: Sequence) -> bool:
    """Clef rows: own effective weights, so they never share cache entries with anyone."""
    return seq.cache_salt is not None and seq.cache_salt.startswith(CLEF_SALT_PREFIX)


# -- memory plan -------------------------------------------------------------------------------
@dataclass(frozen=True)
class PrefixPlan:
    enabled: bool = False
    num_blocks: int = 0  # device KV blocks left once the snapshots took their share of the budget
    interval: int = 0  # tokens between snapshot boundaries
    num_snapshots: int = 0
    reserve_blocks: int = 0  # cached blocks Clef rows may not evict
    host_blocks: int = 0
    host_snapshots: int = 0


def snapshot_interval(requested: int, block_size: int, block_bytes: int, snapshot_bytes: int) -> int:
    if requested:
        if requested < 0 or requested % block_size:
            raise ConfigError(f"gdn_snapshot_interval={requested} must be a positive multiple of "
                              f"block_size={block_size}")
        return requested
    unit = AUTO_INTERVAL_BLOCKS * block_size
    need = snapshot_bytes * block_size / (AUTO_SNAPSHOT_RATIO * block_bytes)  # snapshot bytes / token <= ratio x KV
    return max(1, -(-int(need) // unit)) * unit


def split_budget(budget: int, block_bytes: int, snapshot_bytes: int, blocks_per_snapshot: int) -> tuple[int, int]:
    """(blocks, snapshots) for a byte budget: one snapshot per `blocks_per_snapshot` blocks, so every
    cached block can sit under a snapshot; what is left after whole units goes to blocks."""
    unit = blocks_per_snapshot * block_bytes + snapshot_bytes
    units = budget // unit
    return units * blocks_per_snapshot + (budget - units * unit) // block_bytes, units


def plan_prefix_cache(budget: int, block_bytes: int, snapshot_bytes: int, block_size: int, *, enabled: bool,
                      interval: int, chat_reserve: float, offload_bytes: int) -> PrefixPlan:
    if not 0.0 <= chat_reserve < 1.0:
        raise ConfigError(f"prefix_cache_chat_reserve must be in [0, 1), got {chat_reserve}")
    if not enabled:
        return PrefixPlan(num_blocks=budget // block_bytes)
    iv = snapshot_interval(interval, block_size, block_bytes, snapshot_bytes)
    blocks, snaps = split_budget(budget, block_bytes, snapshot_bytes, iv // block_size)
    host_blocks, host_snaps = split_budget(offload_bytes, block_bytes, snapshot_bytes, iv // block_size)
    return PrefixPlan(True, blocks, iv, snaps, int(blocks * chat_reserve), host_blocks, host_snaps)


# -- digests -----------------------------------------------------------------------------------
def _root(salt: str | None) -> bytes:
    tag = b"\x00" if salt is None else b"\x01" + salt.encode()
    return hashlib.blake2b(b"qv-prefix" + tag, digest_size=16).digest()


def key_digest(key: tuple) -> bytes:
    """key = (parent digest, token ids as int64 bytes, media ((position, hash), ...))."""
    parent, token_bytes, media = key
    h = hashlib.blake2b(parent + token_bytes, digest_size=16)
    for pos, mh in media:
        h.update(f"|{pos}:{mh}".encode())
    return h.digest()


def _token_bytes(seq: Sequence, s: int, e: int) -> bytes:
    n = len(seq.prompt_token_ids)
    if e <= n:
        ids = seq.prompt_token_ids[s:e]
    elif s >= n:
        ids = seq.output_token_ids[s - n:e - n]
    else:
        ids = seq.prompt_token_ids[s:] + seq.output_token_ids[:e - n]
    return array("q", ids).tobytes()


def _block_media(seq: Sequence, j: int, bs: int) -> tuple:
    if not seq.mm_hashes:
        return ()
    return tuple((p, h) for p, h in seq.mm_hashes if j * bs <= p < (j + 1) * bs)


# -- the cache ---------------------------------------------------------------------------------
@dataclass
class PrefixHit:
    num_tokens: int
    blocks: list[int | None]  # device block per reused block, None where it comes back from host
    chain: list[tuple[bytes, tuple]]  # (digest, key) per reused block
    num_in_use: int  # reused blocks already held by running sequences (they cost no free block)


@dataclass
class PrefixCacheStats:
    queries: int = 0  # tokens looked up at admission (vLLM's prefix_cache_queries)
    hits: int = 0  # tokens resumed from the cache, readmissions included (vLLM's prefix_cache_hits)
    prompt_tokens_cached: int = 0  # prompt tokens served from the cache at first admissions
    host_hits: int = 0  # hit tokens whose KV blocks came back from host memory
    host_snapshot_hits: int = 0  # hits whose GDN snapshot came back from host memory
    snapshots_taken: int = 0


class PrefixCache(StepFeature):
    def __init__(self, plan: PrefixPlan, blocks: KVBlockPool, cache: HybridCache):
        self.blocks, self.bs, self.interval = blocks, blocks.block_size, plan.interval
        self.copies = RowCopies()  # every device-state copy below goes through it (tensor parallelism logs them)
        kv = self.copies.add("block", block_tensors(cache))
        self.snaps = GDNSnapshotPool(cache, plan.num_snapshots, self.copies)
        self.host: HostTier | None = None
        if plan.host_blocks or plan.host_snapshots:
            self.host = HostTier(self.copies, plan.host_blocks, plan.host_snapshots, pin=bool(kv) and kv[0].is_cuda)
            self.snaps.on_evict = self.host.save_snapshot
        blocks.on_evict = self._block_evicted
        self.stats = PrefixCacheStats()
        self._roots: dict[str | None, bytes] = {}
        self._memo: tuple[Sequence | None, int, list] = (None, -1, [])

    # -- admission -----------------------------------------------------------------------------
    def match(self, seq: Sequence) -> PrefixHit | None:
        """The longest reusable prefix of a waiting sequence (nothing is taken yet)."""
        if is_isolated(seq):
            return None
        chain = self._full_chain(seq)
        found: list[int | None] = []
        best, cap = 0, cacheable_tokens(seq)  # prompt rows whose logprobs are still to compute are not skipped
        for k, (d, key) in enumerate(chain):
            if (k + 1) * self.bs > cap:
                break
            b = self.blocks.lookup(d, key)
            if b is None and not (self.host and self.host.has_block(d, key)):
                break
            found.append(b)
            if (k + 1) * self.bs % self.interval == 0 and self._has_snapshot(d):
                best = k + 1
        if not best:
            return None
        used = found[:best]
        in_use = sum(1 for b in used if b is not None and self.blocks.ref_counts[b] > 0)
        return PrefixHit(best * self.bs, used, chain[:best], in_use)

    def admit(self, seq: Sequence, hit: PrefixHit | None) -> None:
        """Start an admitted sequence (slot already acquired) from its hit, and count the lookup."""
        if is_isolated(seq):
            return
        self.stats.queries += seq.num_tokens
        if hit is None:
            return
        from_host = [k for k, b in enumerate(hit.blocks) if b is None]
        snap = hit.chain[-1][0]
        if self.host:  # the evictions this restore causes must not drop what it restores
            self.host.pin([hit.chain[k][0] for k in from_host] + [snap])
        for b in hit.blocks:
            if b is not None:
                self.blocks.touch(b)
        ids = list(hit.blocks)
        for k in from_host:
            b = self.blocks.take()
            d, key = hit.chain[k]
            self.host.restore_block(d, b)
            self.blocks.register(b, d, key)
            ids[k] = b
        seq.block_ids = ids
        if snap in self.snaps:
            self.snaps.load(snap, seq.state_slot)
        else:
            self.host.restore_snapshot(snap, seq.state_slot)
            self.stats.host_snapshot_hits += 1
        if self.host:
            self.host.unpin()
        seq.num_computed_tokens = hit.num_tokens
        self.stats.hits += hit.num_tokens
        self.stats.host_hits += len(from_host) * self.bs
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = min(hit.num_tokens, seq.num_prompt_tokens)
            self.stats.prompt_tokens_cached += seq.num_cached_tokens

    # -- scheduling and after the forward ------------------------------------------------------
    def clip(self, seq: Sequence, n: int) -> int:
        """End a chunk of n tokens at the first snapshot boundary inside it whose snapshot is missing."""
        if n <= 1 or is_isolated(seq):
            return n
        c, iv = seq.num_computed_tokens, self.interval
        boundary = (c // iv + 1) * iv
        while boundary < c + n:
            d = self._digest_at(seq, boundary)
            if d is None:  # its prefix cannot be cached (reset while in flight)
                return n
            if not self._has_snapshot(d):
                return boundary - c
            boundary += iv
        return n

    def after_forward(self, scheduled, scheduler) -> list[str]:
        """StepFeature: register and snapshot what the step computed."""
        self.after_step(scheduled)
        return []

    def after_step(self, scheduled) -> None:
        """Register the blocks this step filled and snapshot the sequences sitting on a boundary.
        Call after num_computed_tokens advanced and before finished sequences are freed."""
        saves = []
        for seq, _ in scheduled:
            if seq.state_slot < 0 or is_isolated(seq):
                continue
            c = seq.num_computed_tokens
            self._register_full_blocks(seq, c)
            if c and c % self.interval == 0 and c // self.bs <= len(seq.block_ids):
                d = self.blocks.block_digest[seq.block_ids[c // self.bs - 1]]
                if d and not self._has_snapshot(d):
                    saves.append((seq.state_slot, d))
        if saves:
            before = self.snaps.num_saved
            self.snaps.save(saves)
            self.stats.snapshots_taken += self.snaps.num_saved - before

    def reset(self) -> bool:
        """Forget every cached prefix (device and host). Running requests keep their blocks."""
        self.blocks.reset_cache()
        self.snaps.reset()
        if self.host:
            self.host.reset()
        return True

    # -- helpers -------------------------------------------------------------------------------
    def _has_snapshot(self, d: bytes) -> bool:
        return d in self.snaps or (self.host is not None and self.host.has_snapshot(d))

    def _root(self, seq: Sequence) -> bytes:
        r = self._roots.get(seq.cache_salt)
        if r is None:
            r = self._roots[seq.cache_salt] = _root(seq.cache_salt)
        return r

    def _chain(self, seq: Sequence, parent: bytes, start: int, stop: int) -> list[tuple[bytes, tuple]]:
        """(digest, key) of blocks start..stop-1, chained from `parent` (one bytes slice per block)."""
        out, step, blake = [], self.bs * 8, hashlib.blake2b
        data = _token_bytes(seq, start * self.bs, stop * self.bs)
        if seq.mm_hashes:
            for j in range(start, stop):
                key = (parent, data[(j - start) * step:(j - start + 1) * step], _block_media(seq, j, self.bs))
                parent = key_digest(key)
                out.append((parent, key))
            return out
        for o in range(0, (stop - start) * step, step):  # key_digest inlined: a 32K prompt has 2,048 blocks
            tokens = data[o:o + step]
            key = (parent, tokens, ())
            parent = blake(parent + tokens, digest_size=16).digest()
            out.append((parent, key))
        return out

    def _full_chain(self, seq: Sequence) -> list[tuple[bytes, tuple]]:
        """(digest, key) of every block that may be reused: those before the last token. A queue
        head waiting for room asks every step, so its chain is remembered."""
        memo_seq, memo_len, chain = self._memo
        if memo_seq is not seq or memo_len != seq.num_tokens:
            chain = self._chain(seq, self._root(seq), 0, (seq.num_tokens - 1) // self.bs)
            self._memo = (seq, seq.num_tokens, chain)
        return chain

    def _digest_at(self, seq: Sequence, boundary: int) -> bytes | None:
        """Digest of the block ending at `boundary`, chained from the sequence's registered blocks."""
        k0 = seq.num_computed_tokens // self.bs
        parent = self._root(seq) if k0 == 0 else self.blocks.block_digest[seq.block_ids[k0 - 1]]
        if not parent:
            return None
        if boundary // self.bs == k0:
            return parent
        return self._chain(seq, parent, k0, boundary // self.bs)[-1][0]

    def _register_full_blocks(self, seq: Sequence, c: int) -> None:
        ids, digests = seq.block_ids, self.blocks.block_digest
        full = min(c // self.bs, len(ids))
        k = full
        while k > 0 and digests[ids[k - 1]] is None:  # every earlier full block is registered already
            k -= 1
        parent = self._root(seq) if k == 0 else digests[ids[k - 1]]
        if parent == NO_CACHE:
            for j in range(k, full):
                self.blocks.mark_uncacheable(ids[j])
            return
        for j, (d, key) in enumerate(self._chain(seq, parent, k, full), start=k):
            b = ids[j]
            cached = self.blocks.lookup(d, key)
            if cached is None:
                if not self.blocks.register(b, d, key):  # a true digest collision: never cache this one
                    self.blocks.mark_uncacheable(b)
            elif cached != b:  # the same prefix is cached already: share it, give back the copy
                self.blocks.touch(cached)
                ids[j] = cached
                self.blocks.release([b])

    def _block_evicted(self, b: int, digest: bytes, key: tuple) -> None:
        if self.host is not None:
            self.host.save_block(b, digest, key)
        else:  # its prefix is gone, so a snapshot at its end can never be reached again
            self.snaps.drop(digest)


def make_prefix_cache(plan: PrefixPlan, blocks: KVBlockPool, cache: HybridCache) -> PrefixCache | None:
    return PrefixCache(plan, blocks, cache) if plan.enabled else None


def replica_pools(plan: PrefixPlan, cache: HybridCache) -> RowCopies | None:
    """A tensor-parallel worker's state pools: the driver's (same rows, built by the same code) over this
    rank's cache shard, to replay the driver's logged copies on; None with prefix caching off."""
    if not plan.enabled:
        return None
    return PrefixCache(plan, KVBlockPool(cache.num_blocks, cache.block_size), cache).copies
