"""Bookkeeping of the prefix cache without a model: block LRU and reference counts, the content
check behind every digest, the chat reserve, snapshot LRU, memory planning."""

from __future__ import annotations

import pytest
import torch

from qv.config import ConfigError
from qv.engine.host_tier import HostTier
from qv.engine.kv_cache import KVBlockPool
from qv.engine.prefix_cache import (PrefixCache, PrefixPlan, plan_prefix_cache, replica_pools, snapshot_interval,
                                    split_budget)
from qv.engine.state_pool import GDNSnapshotPool, RowCopies, slot_tensors
from qv.model.cache import GDNState, HybridCache, KVCache


def _cached(pool: KVBlockPool, n: int) -> list[int]:
    """n held blocks registered under digests d0.., then released (they become cached-free)."""
    ids: list[int] = []
    pool.grow(ids, n * pool.block_size)
    for i, b in enumerate(ids):
        assert pool.register(b, f"d{i}".encode(), ("key", i))
    held = list(ids)
    pool.release(ids)
    return held


def test_released_blocks_stay_findable_and_uncached_ones_go_first():
    pool = KVBlockPool(6, 4)
    blocks = _cached(pool, 3)
    assert pool.num_free == 6 and pool.num_cached == 3
    assert pool.lookup(b"d1", ("key", 1)) == blocks[1]
    fresh: list[int] = []
    pool.grow(fresh, 3 * 4)  # three never-cached blocks are free: no eviction
    assert not set(fresh) & set(blocks) and pool.num_evictions == 0 and pool.num_cached == 3
    evicted = []
    pool.on_evict = lambda b, d, key: evicted.append(d)
    more: list[int] = []
    pool.grow(more, 2 * 4)  # now LRU eviction, tail of the released chain first
    assert evicted == [b"d2", b"d1"]
    assert pool.lookup(b"d0", ("key", 0)) == blocks[0] and pool.lookup(b"d2", ("key", 2)) is None


def test_hit_shares_block_and_revives_it_from_the_lru():
    pool = KVBlockPool(4, 4)
    b = _cached(pool, 1)[0]
    pool.touch(b)
    pool.touch(b)
    assert pool.ref_counts[b] == 2 and b not in pool.cached_free and pool.num_free == 3
    pool.release([b])
    assert pool.ref_counts[b] == 1 and b not in pool.cached_free
    pool.release([b])
    assert b in pool.cached_free and pool.num_free == 4


def test_digest_collision_is_a_miss():
    pool = KVBlockPool(4, 4)
    b = _cached(pool, 1)[0]
    assert pool.lookup(b"d0", ("key", 0)) == b
    assert pool.lookup(b"d0", ("other tokens", 0)) is None
    ids: list[int] = []
    pool.grow(ids, 4)
    assert not pool.register(ids[0], b"d0", ("other tokens", 0))  # the first owner keeps the digest


def test_isolated_sequences_leave_the_reserve_alone():
    pool = KVBlockPool(10, 4, reserve_blocks=4)
    _cached(pool, 6)  # 6 cached-free + 4 plain free
    assert pool.num_available() == 10
    assert pool.num_available(isolated=True) == 4 + (6 - 4)
    assert pool.capacity(isolated=True) == 6 and pool.capacity() == 10
    assert pool.can_grow(0, 6 * 4, isolated=True) and not pool.can_grow(0, 7 * 4, isolated=True)
    ids: list[int] = []
    pool.grow(ids, 6 * 4)
    assert pool.num_cached == 4  # exactly the reserve survived


def test_reset_forgets_free_and_held_prefixes():
    pool = KVBlockPool(4, 4)
    _cached(pool, 2)
    held: list[int] = []
    pool.grow(held, 4)
    pool.register(held[0], b"h", ("h",))
    pool.reset_cache()
    assert pool.num_cached == 0 and pool.num_free == 3 and not pool.cached_free
    pool.release(held)
    assert pool.num_free == 4 and not pool.cached_free  # a held block never comes back as cached


def _tiny_cache(slots: int = 3, int16: bool = False) -> HybridCache:
    st = GDNState(conv=torch.randn(slots, 3, 5), ssm=torch.randn(slots, 2, 4, 4),
                  ssm_scale=torch.rand(slots, 2, 4) if int16 else None)
    return HybridCache(kv={}, gdn={1: st}, block_size=4)


@pytest.mark.parametrize("int16", [False, True])
def test_snapshots_copy_exactly_and_evict_lru(int16):
    cache = _tiny_cache(int16=int16)
    pool = GDNSnapshotPool(cache, 2)
    original = [t.clone() for t in slot_tensors(cache)]
    evicted = []
    pool.on_evict = lambda row, d: evicted.append(d)
    pool.save([(0, b"a"), (1, b"b"), (1, b"b")])
    assert len(pool) == 2
    pool.load(b"a", 2)  # touch: b is now the least recently used
    for t, o in zip(slot_tensors(cache), original):
        assert torch.equal(t[2], o[0])
    pool.save([(2, b"c")])
    assert evicted == [b"b"] and b"a" in pool and b"c" in pool


def test_host_tier_round_trip_and_pinning():
    cache = _tiny_cache()
    copies = RowCopies()
    copies.add("block", [])
    slots = copies.add("slot", slot_tensors(cache))
    copies.add("snapshot", slots)  # offload straight from the slots
    host = HostTier(copies, 0, 1, pin=False)
    want = [t[1].clone() for t in slots]
    host.save_snapshot(1, b"s")
    for t in slots:
        t[0].zero_()
    host.restore_snapshot(b"s", 0)
    assert all(torch.equal(t[0], w) for t, w in zip(slots, want))
    host.pin([b"s"])
    host.save_snapshot(2, b"t")  # the only row is pinned: nothing is dropped
    assert host.has_snapshot(b"s") and not host.has_snapshot(b"t")
    host.unpin()
    host.save_snapshot(2, b"t")
    assert host.has_snapshot(b"t") and not host.has_snapshot(b"s")


def test_logged_copies_replay_on_another_ranks_pools():
    """A tensor-parallel worker's part: the driver's logged state copies (snapshot saves, an eviction to
    host, loads, host restores of a block and a snapshot) replayed on pools built from the same plan over
    other contents (2x the driver's here) move exactly the same rows."""
    def cache():
        kv = KVCache(k=torch.randn(6, 4, 1, 2), v=torch.randn(6, 4, 1, 2), k_scale=None, v_scale=None)
        return HybridCache(kv={0: kv}, gdn=_tiny_cache().gdn, block_size=4)

    plan = PrefixPlan(True, num_blocks=6, interval=4, num_snapshots=2, host_blocks=2, host_snapshots=2)
    mine = cache()
    driver = PrefixCache(plan, KVBlockPool(6, 4), mine)
    other = HybridCache(kv={0: KVCache(mine.kv[0].k * 2, mine.kv[0].v * 2, None, None)},
                        gdn={i: GDNState(st.conv * 2, st.ssm * 2, None) for i, st in mine.gdn.items()}, block_size=4)
    driver.copies.start_log()
    driver.snaps.save([(0, b"a"), (1, b"b")])
    driver.snaps.save([(2, b"c")])  # evicts a to the host tier
    driver.snaps.load(b"b", 0)
    driver.host.save_block(3, b"x", ("k",))
    driver.host.restore_block(b"x", 5)
    driver.host.restore_snapshot(b"a", 1)
    ops = driver.copies.take_log()
    assert [(d, s) for d, _, s, _ in ops] == [("snapshot", "slot"), ("host_snapshot", "snapshot"), ("snapshot", "slot"),
                                              ("slot", "snapshot"), ("host_block", "block"), ("block", "host_block"),
                                              ("slot", "host_snapshot")]
    assert driver.copies.take_log() == ()
    replica = replica_pools(plan, other)
    replica.replay(ops)
    assert replica.pools.keys() == driver.copies.pools.keys()
    for name, tensors in driver.copies.pools.items():
        for t, u in zip(tensors, replica.pools[name], strict=True):
            assert torch.equal(u, t * 2), name


def test_memory_plan():
    # 27B shape numbers: 64 KiB of bf16 KV per token, 147 MiB of fp32 state per snapshot
    block, snap = 16 * 65536, 154_400_000
    assert snapshot_interval(0, 16, block, snap) == 5120  # snapshots <= half the KV bytes per token
    assert snapshot_interval(0, 16, block, snap // 2) == 3072
    assert snapshot_interval(2048, 16, block, snap) == 2048
    with pytest.raises(ConfigError):
        snapshot_interval(1000, 16, block, snap)
    assert split_budget(1800, 100, 50, 5) == (16, 3)  # 3 units of 5 blocks + 1 snapshot, 1 block left over
    plan = plan_prefix_cache(1 << 30, block, snap, 16, enabled=True, interval=0, chat_reserve=0.25, offload_bytes=0)
    assert plan.num_blocks * block + plan.num_snapshots * snap <= 1 << 30
    assert plan.num_snapshots * (plan.interval // 16) <= plan.num_blocks and plan.reserve_blocks == plan.num_blocks // 4
    off = plan_prefix_cache(1 << 30, block, snap, 16, enabled=False, interval=0, chat_reserve=0.25, offload_bytes=0)
    assert off.num_blocks == 1024 and off.num_snapshots == 0 and off.reserve_blocks == 0
