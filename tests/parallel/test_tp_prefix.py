"""Prefix caching under tensor parallelism, on the CPU over gloo: the driver keeps the prefix cache's
bookkeeping and logs its copies of device state (GDN snapshot saves and loads, host-tier offloads and
restores), and the worker replays them on its own shard before each forward. Requests that share long
prefixes (hits restoring a snapshot 4 and 5 intervals in, two at once in one step, a later turn over a
snapshot taken in decode), then unrelated prompts that evict blocks and snapshots under a small KV
budget, then the shared prefixes again: greedy tokens and logprobs at TP 2 equal TP 1 with prefix
caching on and with it off, and the hit counters show the hits really ran. A worker that skipped a
load would start its GDN heads from another request's state, far beyond the fp32 bound.
"""

from __future__ import annotations

import random

import pytest
import torch

from qv import SamplingParams
from qv.config import ModelConfig
from qv.model.cache import gdn_bytes_per_slot, kv_bytes_per_block
from qv.model.parallel import rank_config
from test_tp_engine import TOP, TOP_BOUND, close_logprob, top_logprobs  # tests/parallel is on the path
from util import assert_close

BS, IV = 8, 16  # block size; snapshot interval (two blocks: the prompts cross several)
BLOCKS, HOST_BLOCKS = 24, 40  # device KV blocks (unrelated prompts evict), host tier blocks
LEVERS = dict(block_size=BS, gdn_snapshot_interval=IV, max_num_batched_tokens=32, max_num_seqs=3)
MAX_TOKENS = 12


def budget(model_dir: str, world: int, blocks: int) -> int:
    """kv_cache_bytes that plans exactly `blocks` blocks per rank (one snapshot per IV tokens of them)."""
    cfg = rank_config(ModelConfig.from_dir(model_dir), world)
    block, snap = kv_bytes_per_block(cfg, BS, torch.float32), gdn_bytes_per_slot(cfg, torch.float32, torch.float32)
    per = IV // BS
    return blocks // per * (per * block + snap) + blocks % per * block


@pytest.fixture(scope="module")
def case(tiny_dirs):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)

    def toks(n):
        return [rng.randrange(300) for _ in range(n)]

    a, b = toks(70), toks(45)
    # wave 1 fills the cache; wave 2 hits it (2 at 64 in one step, a later turn at 80); wave 3 evicts;
    # wave 4 asks the shared prefixes again
    waves = [[a + toks(5), b], [a + toks(9), a + toks(20), "turn"], [toks(60) for _ in range(3)],
             [a + toks(7), b + toks(4), a + toks(3)]]
    return str(tiny_dirs("gqa1")), waves, toks(6), seed  # gqa1: 2 KV heads, 2 GDN heads: one of each a rank


def run(tiny_engine, model_dir, waves, turn_tail, world=1, prefix=True, host=False):
    """(prompts, outputs, engine stats, prefix-cache counters) over the waves, each wave run to the end."""
    levers = dict(LEVERS, prefix_caching=prefix, tensor_parallel_size=world)
    if prefix:
        levers["kv_cache_bytes"] = budget(model_dir, world, BLOCKS)
        levers["kv_offload_bytes"] = budget(model_dir, world, HOST_BLOCKS) if host else 0
    llm = tiny_engine(model=model_dir, **levers)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)
    try:
        prompts, outs = [], []
        for wave in waves:
            # the later turn: the first request, its answer and more
            wave = [prompts[0] + outs[0].outputs[0].token_ids + turn_tail if p == "turn" else p for p in wave]
            prompts += wave
            outs += llm.generate([{"prompt_token_ids": p} for p in wave], params, use_tqdm=False)
        pc = llm.engine.prefix_cache
        counters = None if pc is None else dict(
            stats=vars(pc.stats).copy(), snapshots_saved=pc.snaps.num_saved, num_snapshots=pc.snaps.num_snapshots,
            evictions=llm.engine.blocks.num_evictions,
            host=None if pc.host is None else (pc.host.blocks_offloaded, pc.host.snapshots_offloaded,
                                               pc.host.blocks_restored, pc.host.snapshots_restored))
        return prompts, outs, vars(llm.engine.stats).copy(), counters
    finally:
        llm.engine.shutdown()


@pytest.fixture(scope="module")
def caching_off(tiny_engine, case):
    model_dir, waves, tail, _ = case
    return run(tiny_engine, model_dir, waves, tail, prefix=False)


def compare(label, got, ref, model_dir, seed) -> None:
    """Tokens, ranks, chosen-token logprobs (|d| < 1e-4, else within the transformers oracle) and top-5
    logprobs (relative 1e-5) of every request."""
    errs, top_errs = [], []
    for i, (prompt, g, r) in enumerate(zip(got[0], got[1], ref[1])):
        name, out = f"{label} request {i} (len {len(prompt)}, seed {seed})", g.outputs[0].token_ids
        assert out == r.outputs[0].token_ids, name
        for j, (tok, ge, re) in enumerate(zip(out, g.outputs[0].logprobs, r.outputs[0].logprobs)):
            assert ge[tok].rank == re[tok].rank, f"{name} token {j}"
            errs.append(close_logprob(f"{name} token {j}", prompt + out[:j], tok, ge[tok].logprob, re[tok].logprob,
                                      model_dir))
        top_errs.append(assert_close(f"{name} top-{TOP} logprobs", top_logprobs(g), top_logprobs(r), TOP_BOUND))
    print(f"{label}, seed {seed}: {len(errs)} chosen logprobs, median difference {sorted(errs)[len(errs) // 2]:.1e}, "
          f"worst {max(errs):.1e}; top-{TOP} relative worst {max(top_errs):.1e}")


@pytest.mark.timeout(300)  # a collective the ranks do not share would wait out the process group timeout
@pytest.mark.parametrize("host", [False, True], ids=["device", "host-tier"])
def test_tp2_prefix_caching_equals_tp1(tiny_engine, case, caching_off, host):
    model_dir, waves, tail, seed = case
    tp1 = run(tiny_engine, model_dir, waves, tail, host=host)
    tp2 = run(tiny_engine, model_dir, waves, tail, world=2, host=host)
    compare("TP 2 vs TP 1, both caching", tp2, tp1, model_dir, seed)
    compare("TP 2 caching vs TP 1 not", tp2, caching_off, model_dir, seed)
    assert tp2[3] == tp1[3] and tp2[2]["num_preemptions"] == tp1[2]["num_preemptions"], \
        "the driver's bookkeeping saw the same workload"
    cached = [o.num_cached_tokens for o in tp2[1]]
    assert cached[:2] == [0, 0] and cached[2:5] == [64, 64, 80], cached  # 8 blocks (4 intervals), 10 (5)
    c = tp2[3]
    assert c["stats"]["hits"] >= 208 and c["stats"]["prompt_tokens_cached"] >= 208
    assert c["snapshots_saved"] > c["num_snapshots"] and c["evictions"] > 0, "wave 3 was meant to evict"
    assert sum(cached[-3:]) > 0, "wave 4 was meant to hit what wave 3 left"
    if host:
        offloaded_blocks, offloaded_snaps, restored_blocks, restored_snaps = c["host"]
        assert offloaded_blocks and offloaded_snaps and restored_blocks and restored_snaps, c["host"]
        assert c["stats"]["host_hits"] > 0 and c["stats"]["host_snapshot_hits"] > 0
    else:
        assert c["host"] is None
