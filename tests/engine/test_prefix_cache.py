"""Prefix caching end to end on the tiny hybrid model: what is reused is asserted through the
engine's stats and the tokens the forward actually computed, and every output must equal the
output of a run with prefix caching off."""

from __future__ import annotations

import random

import torch

from qv import LLM, SamplingParams
from qv.config import ModelConfig
from qv.model.cache import gdn_bytes_per_slot, kv_bytes_per_block

BS, IV = 16, 32  # block size; snapshot interval (two blocks, so the tiny prompts cross several)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _budget(model_dir: str, blocks: int, state_dtype=torch.float32) -> int:
    """kv_cache_bytes that plans exactly `blocks` blocks (and one snapshot per IV tokens of them)."""
    cfg = ModelConfig.from_dir(model_dir)
    block, snap = kv_bytes_per_block(cfg, BS, torch.float32), gdn_bytes_per_slot(cfg, torch.float32, state_dtype)
    per = IV // BS
    return blocks // per * (per * block + snap) + blocks % per * block


def _llm(tiny_engine, model_dir: str, **levers) -> LLM:
    levers.setdefault("gdn_snapshot_interval", IV)
    return tiny_engine(model=model_dir, block_size=BS, **levers)


def _count_forward(llm: LLM) -> list[list[tuple[str, int]]]:
    """Record (request id, tokens) of every row each forward computes."""
    steps: list[list[tuple[str, int]]] = []
    execute = llm.engine.runner.execute

    def counted(plan):
        steps.append([(s.request_id, n) for s, n in plan.scheduled])
        return execute(plan)

    llm.engine.runner.execute = counted
    return steps


def _run(llm: LLM, requests: list[dict]) -> list:
    """requests: dicts with ids, params and optionally salt / mm; returns finished outputs in order."""
    eng, rids = llm.engine, []
    for r in requests:
        rid = f"r{llm._next_id}"
        llm._next_id += 1
        eng.add_request(rid, r["ids"], r.get("params", GREEDY), cache_salt=r.get("salt"), mm_hashes=r.get("mm"))
        rids.append(rid)
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    return [done[rid] for rid in rids]


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _assert_nothing_held(llm: LLM) -> None:
    blocks = llm.engine.blocks
    assert blocks.num_free == blocks.num_blocks and not any(blocks.ref_counts)


def test_multi_turn_chat_computes_only_tokens_beyond_the_last_snapshot(tiny_engine, tiny_dirs):
    model_dir = str(tiny_dirs("tiny"))
    rng = random.Random(7)
    turn1 = [rng.randrange(300) for _ in range(70)]
    params = SamplingParams(temperature=0, max_tokens=26, ignore_eos=True)
    llm = _llm(tiny_engine, model_dir)
    out1 = _run(llm, [{"ids": turn1, "params": params}])[0]
    turn2 = turn1 + out1.outputs[0].token_ids + [rng.randrange(300) for _ in range(15)]
    stats = llm.engine.stats
    assert (stats.prefix_cache_hits, stats.prompt_tokens_cached) == (0, 0)
    steps = _count_forward(llm)
    out2 = _run(llm, [{"ids": turn2, "params": params}])[0]
    # turn 1 computed its prompt and all but its last output token; snapshots sit every IV tokens
    reusable = (len(turn1) + len(out1.outputs[0].token_ids) - 1) // IV * IV
    assert reusable == 64
    assert out2.num_cached_tokens == reusable
    assert stats.prompt_tokens_cached == reusable and stats.prefix_cache_hits == reusable
    assert stats.prefix_cache_queries == len(turn1) + len(turn2)
    prefill = sum(n for step in steps for _, n in step) - (params.max_tokens - 1)  # minus the decode steps
    assert prefill == len(turn2) - reusable
    cold = _run(_llm(tiny_engine, model_dir, prefix_caching=False), [{"ids": turn2, "params": params}])[0]
    assert out2.outputs[0].token_ids == cold.outputs[0].token_ids
    _assert_nothing_held(llm)


def test_int16_state_snapshots_resume_exactly(tiny_engine, tiny_dirs):
    model_dir = str(tiny_dirs("gqa3"))
    rng = random.Random(3)
    prefix = [rng.randrange(300) for _ in range(100)]
    asks = [prefix + [rng.randrange(300) for _ in range(9)] for _ in range(2)]
    llm = _llm(tiny_engine, model_dir, gdn_state_dtype="int16")
    warm = _run(llm, [{"ids": asks[0]}])[0]
    hot = _run(llm, [{"ids": asks[1]}])[0]
    assert (warm.num_cached_tokens, hot.num_cached_tokens) == (0, 96)
    cold = _run(_llm(tiny_engine, model_dir, gdn_state_dtype="int16", prefix_caching=False), [{"ids": asks[1]}])[0]
    assert hot.outputs[0].token_ids == cold.outputs[0].token_ids


def test_prefill_chunks_end_on_snapshot_boundaries(tiny_engine, tiny_dirs):
    model_dir = str(tiny_dirs("tiny"))
    llm = _llm(tiny_engine, model_dir, max_num_batched_tokens=48)
    steps = _count_forward(llm)
    prompt = list(range(3, 103))
    _run(llm, [{"ids": prompt, "params": SamplingParams(temperature=0, max_tokens=1)}])
    assert [n for step in steps for _, n in step] == [32, 32, 32, 4]  # 48-token chunks cut at 32, 64, 96
    assert llm.engine.prefix_cache.stats.snapshots_taken == 3
    again = _run(llm, [{"ids": prompt + [7, 8, 9]}])[0]
    assert again.num_cached_tokens == 96


def test_salts_and_media_isolate(tiny_engine, tiny_dirs):
    model_dir = str(tiny_dirs("tiny"))
    prompt = list(range(10, 80))  # 70 tokens: 64 reusable
    llm = _llm(tiny_engine, model_dir)
    pc = llm.engine.prefix_cache
    outs = _run(llm, [{"ids": prompt, "salt": "a"}])
    outs += _run(llm, [{"ids": prompt, "salt": "b"}])
    outs += _run(llm, [{"ids": prompt}])
    outs += _run(llm, [{"ids": prompt, "mm": [(5, "img-1")]}])
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0, 0], "nothing may be shared across salts or media"
    outs += _run(llm, [{"ids": prompt, "salt": "a"}])
    outs += _run(llm, [{"ids": prompt, "mm": [(5, "img-1")]}])
    outs += _run(llm, [{"ids": prompt, "mm": [(40, "img-1")]}])  # the media item moved: blocks 0-1 still match
    assert [o.num_cached_tokens for o in outs[4:]] == [64, 64, 32]
    # Clef rows neither read nor write the cache
    cached, snaps = llm.engine.blocks.num_cached, len(pc.snaps)
    clef = _run(llm, [{"ids": prompt, "salt": "clef:rec"}, {"ids": prompt, "salt": "clef:rec"}])
    clef += _run(llm, [{"ids": prompt, "salt": "clef:rec"}])
    assert [o.num_cached_tokens for o in clef] == [0, 0, 0]
    assert (llm.engine.blocks.num_cached, len(pc.snaps)) == (cached, snaps)
    assert len({tuple(t) for t in _tokens(outs + clef)}) == 1  # the tiny model ignores salts and hashes
    _assert_nothing_held(llm)


def _clef_burst_then_chat(tiny_engine, model_dir: str, reserve: float) -> tuple[int, list]:
    llm = _llm(tiny_engine, model_dir, kv_cache_bytes=_budget(model_dir, 24), prefix_cache_chat_reserve=reserve)
    assert llm.engine.blocks.num_blocks == 24
    chat = list(range(20, 120))  # 6 full blocks, snapshots at 32, 64, 96
    _run(llm, [{"ids": chat, "params": SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)}])
    rng = random.Random(1)
    records = [{"ids": [rng.randrange(300) for _ in range(150)], "salt": f"clef:{i}",
                "params": SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)} for i in range(3)]
    clef = _run(llm, records)  # 10 blocks each: two at once only if they may evict chat's blocks
    hit = _run(llm, [{"ids": chat + [5, 6, 7]}])[0].num_cached_tokens
    _assert_nothing_held(llm)
    return hit, _tokens(clef)


def test_clef_burst_cannot_flush_the_chat_reserve(tiny_engine, tiny_dirs):
    model_dir = str(tiny_dirs("tiny"))
    kept, with_reserve = _clef_burst_then_chat(tiny_engine, model_dir, 0.5)
    flushed, without = _clef_burst_then_chat(tiny_engine, model_dir, 0.0)
    assert kept == 96
    assert flushed < 96, "the control: without the reserve the burst evicts chat's cached blocks"
    assert with_reserve == without


def test_random_overlapping_workload_matches_caching_off(tiny_engine, tiny_dirs):
    model_dir = str(tiny_dirs("tiny"))
    rng = random.Random(2024)
    bases = [[rng.randrange(300) for _ in range(rng.randrange(50, 90))] for _ in range(3)]
    requests = []
    for i in range(16):
        base = rng.choice(bases)
        ids = base[:rng.randrange(20, len(base) + 1)] + [rng.randrange(300) for _ in range(rng.randrange(1, 25))]
        sampled = i % 5 == 4  # seeded sampling must be reproducible from a cached prefix too
        params = SamplingParams(temperature=0.8 if sampled else 0, seed=i, max_tokens=rng.randrange(10, 30),
                                ignore_eos=True)
        requests.append({"ids": ids, "params": params, "salt": "s" if i % 7 == 3 else None})
    ref = _tokens(_run(_llm(tiny_engine, model_dir, prefix_caching=False), requests))
    # 12 blocks: a request needs up to 9, so growth during decode preempts
    llm = _llm(tiny_engine, model_dir, kv_cache_bytes=_budget(model_dir, 12), max_num_batched_tokens=48, max_num_seqs=6)
    got = _tokens(_run(llm, requests[:8]) + _run(llm, requests[8:]))
    stats = llm.engine.stats
    assert stats.num_preemptions > 0, "the budget was meant to force preemption"
    assert stats.prompt_tokens_cached > 0
    assert stats.prefix_cache_hits > stats.prompt_tokens_cached, "readmissions after preemption should hit"
    assert got == ref
    _assert_nothing_held(llm)


def test_host_tier_restores_evicted_prefix(tiny_engine, tiny_dirs):
    model_dir = str(tiny_dirs("tiny"))
    llm = _llm(tiny_engine, model_dir, kv_cache_bytes=_budget(model_dir, 16), kv_offload_bytes=_budget(model_dir, 32))
    pc = llm.engine.prefix_cache
    rng = random.Random(5)
    doc = [rng.randrange(300) for _ in range(100)]
    _run(llm, [{"ids": doc + [1, 2]}])
    for _ in range(3):  # unrelated prompts of 10 blocks each push the document off the device
        _run(llm, [{"ids": [rng.randrange(300) for _ in range(150)]}])
    assert pc.host.blocks_offloaded >= 6 and pc.host.snapshots_offloaded >= 1
    steps = _count_forward(llm)
    ask = doc + [rng.randrange(300) for _ in range(11)]
    out = _run(llm, [{"ids": ask}])[0]
    stats = llm.engine.stats
    assert out.num_cached_tokens == 96 and stats.prefix_cache_host_hits == 96  # all six blocks from host
    assert pc.host.blocks_restored == 6 and pc.stats.host_snapshot_hits == 1
    assert sum(n for step in steps for _, n in step) == len(ask) - 96 + GREEDY.max_tokens - 1
    cold = _run(_llm(tiny_engine, model_dir, prefix_caching=False), [{"ids": ask}])[0]
    assert out.outputs[0].token_ids == cold.outputs[0].token_ids
    _assert_nothing_held(llm)


def test_reset_prefix_cache(tiny_engine, tiny_dirs):
    model_dir = str(tiny_dirs("tiny"))
    llm = _llm(tiny_engine, model_dir)
    prompt = list(range(50, 130))
    _run(llm, [{"ids": prompt}])
    assert _run(llm, [{"ids": prompt}])[0].num_cached_tokens == 64
    assert llm.engine.reset_prefix_cache() is True
    assert llm.engine.blocks.num_cached == 0 and len(llm.engine.prefix_cache.snaps) == 0
    assert _run(llm, [{"ids": prompt}])[0].num_cached_tokens == 0
    assert _llm(tiny_engine, model_dir, prefix_caching=False).engine.reset_prefix_cache() is False


def test_async_engine_resets_between_steps(tiny_dirs):
    import asyncio

    from qv.config import EngineConfig
    from qv.engine.async_engine import AsyncLLMEngine

    eng = AsyncLLMEngine(EngineConfig.from_env(model=str(tiny_dirs("tiny")), block_size=BS, gdn_snapshot_interval=IV))
    prompt = list(range(40, 110))

    async def ask() -> int:
        async for out in eng.generate(f"q{random.random()}", prompt, GREEDY):
            last = out
        return last.num_cached_tokens

    async def scenario() -> list:
        return [await ask(), await ask(), await eng.reset_prefix_cache(), await ask()]

    try:
        assert asyncio.run(scenario()) == [0, 64, True, 0]
    finally:
        eng.shutdown()


def test_block_digests_chain_by_key_digest(tiny_engine, tiny_dirs):
    """The text-only fast path of the digest chain gives what key_digest gives for each block's key,
    and media hashes change the digests from their block on."""
    from qv.engine.prefix_cache import key_digest
    from qv.engine.sequence import Sequence

    llm = _llm(tiny_engine, str(tiny_dirs("tiny")))
    cache = llm.engine.prefix_cache
    rng = random.Random(5)
    ids = [rng.randrange(3, 300) for _ in range(cache.bs * 7 + 5)]
    text = Sequence(0, "a", 0, ids, SamplingParams(), 1, 0, None, 0)
    chain = cache._full_chain(text)
    assert len(chain) == 7
    parent = cache._root(text)
    for digest, key in chain:
        assert key[0] == parent and digest == key_digest(key)
        parent = digest
    media = Sequence(1, "b", 0, ids, SamplingParams(), 1, 0, None, 1, mm_hashes=[(cache.bs * 3 + 2, "f" * 32)])
    with_media = cache._full_chain(media)
    assert [d for d, _ in with_media[:3]] == [d for d, _ in chain[:3]]
    assert all(a[0] != b[0] for a, b in zip(with_media[3:], chain[3:]))
