"""Sparse attention through the engine (issue 35), tiny model on the CPU (the reference ops): with every block
kept (sparse_mass 1, sparse_decode_top 1) greedy tokens equal exact attention's, through chunked prefill,
decode and a batch; with the original's settings the engine runs sparse steps (blocks are dropped) and the
page tables every layer keeps equal its cache's keys recomputed from scratch after the run; the tables cost
nothing with the levers off and are counted in the memory plan with them on; kernels=sm70 refuses the levers
by name before anything loads."""

from __future__ import annotations

import random

import pytest
import torch

from qv import SamplingParams
from qv.config import ConfigError
from qv.kernels.paged_attention import sparse_reference as S

BLOCK = 4
LEVERS = dict(block_size=BLOCK, sparse_block_tokens=2 * BLOCK, max_num_batched_tokens=32, prefix_caching=False)


def _prompts(n=3):
    rng = random.Random(random.randrange(1 << 30))
    return [{"prompt_token_ids": [rng.randrange(1, 300) for _ in range(rng.randrange(40, 90))]} for _ in range(n)]


def test_keep_all_equals_exact_attention(tiny_engine):
    prompts, params = _prompts(), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    exact = tiny_engine(**LEVERS).generate(prompts, params)
    llm = tiny_engine(**LEVERS, sparse_prefill=True, sparse_decode=True, sparse_mass=1.0, sparse_min_len=0,
                      sparse_decode_top=1.0, sparse_decode_min_blocks=1)
    sparse = llm.generate(prompts, params)
    for a, b in zip(sparse, exact):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            tok = next(iter(lb))
            assert abs(la[tok].logprob - lb[tok].logprob) < 1e-5
    assert all(kv.sparse is not None for kv in llm.engine.runner.cache.kv.values())


def test_sparse_steps_run_and_tables_stay_fresh(tiny_engine, monkeypatch):
    calls = {"prefill": 0, "decode": 0, "dropped": 0}
    select_prefill, select_decode = S.select_prefill, S.select_decode

    def spy(kind, fn):
        def wrapped(*a, **kw):
            keep = fn(*a, **kw)
            calls[kind] += 1
            seq, pos = S._row_positions(a[1], a[2], a[0].shape[0])
            visible = torch.arange(keep.shape[-1])[None, :] * (2 * BLOCK) <= pos[:, None]
            calls["dropped"] += int((visible[:, None, :] & ~keep).sum())
            return keep
        return wrapped

    monkeypatch.setattr(S, "select_prefill", spy("prefill", select_prefill))
    monkeypatch.setattr(S, "select_decode", spy("decode", select_decode))
    llm = tiny_engine(**LEVERS, sparse_prefill=True, sparse_decode=True, sparse_mass=0.85, sparse_rule="estimate",
                      sparse_min_len=0, sparse_decode_top=0.15, sparse_decode_min_blocks=2)
    out = llm.generate(_prompts(), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 10 for o in out)
    assert calls["prefill"] and calls["decode"] and calls["dropped"], calls
    # every used page's tables equal its keys' mean and spread (the last write refreshed them)
    engine = llm.engine
    for kv in engine.runner.cache.kv.values():
        used = kv.sparse.dev.abs().sum((1, 2)) > 0
        for page in torch.nonzero(used[:-1]).flatten().tolist():
            rows = kv.k[page].float()
            filled = int((rows.abs().sum((1, 2)) > 0).sum())
            m = rows[:filled].mean(0)
            torch.testing.assert_close(kv.sparse.mean[page], m, rtol=1e-5, atol=1e-6)


def test_tables_cost_nothing_off_and_are_planned_on(tiny_engine):
    off = tiny_engine(**LEVERS, max_num_seqs=2)
    assert all(kv.sparse is None for kv in off.engine.runner.cache.kv.values())
    on = tiny_engine(**LEVERS, max_num_seqs=2, sparse_decode=True)
    assert on.engine.memory_plan.kv_block_bytes > off.engine.memory_plan.kv_block_bytes
    kv = next(iter(on.engine.runner.cache.kv.values()))
    assert kv.sparse.mean.shape[0] == kv.k.shape[0] + 1


def test_sm70_chain_and_host_tier_refuse_the_levers_by_name(tiny_engine):
    for lever in ("sparse_prefill", "sparse_decode"):
        with pytest.raises(ConfigError, match=f"{lever}: sparse attention is not built for the sm70"):
            tiny_engine(**LEVERS, kernels="sm70", **{lever: True})
    with pytest.raises(ConfigError, match="sparse_decode with kv_offload_bytes is not built"):
        tiny_engine(**dict(LEVERS, prefix_caching=True), kv_offload_bytes=1 << 20, sparse_decode=True)
    with pytest.raises(ConfigError, match="sparse_block_tokens=6 must be a multiple of block_size=4"):
        tiny_engine(**dict(LEVERS, sparse_block_tokens=6), sparse_prefill=True)


@pytest.mark.gpu
def test_keep_all_equals_exact_attention_with_decode_graphs(tiny_engine):
    """On the GPU (Triton kernels, captured decode graphs whose start-up check replays them against the eager
    forward): keep-all sparse attention gives exact attention's greedy tokens, and the original's settings run."""
    prompts, params = _prompts(4), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    gpu = dict(LEVERS, device="cuda", dtype="float32", cuda_graphs=True)
    exact = tiny_engine(**gpu).generate(prompts, params)
    keep_all = tiny_engine(**gpu, sparse_prefill=True, sparse_decode=True, sparse_mass=1.0, sparse_min_len=0,
                           sparse_decode_top=1.0, sparse_decode_min_blocks=1).generate(prompts, params)
    for a, b in zip(keep_all, exact):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    llm = tiny_engine(**gpu, sparse_prefill=True, sparse_decode=True, sparse_min_len=0, sparse_decode_min_blocks=2)
    assert llm.engine.stats.cuda_graph_sizes  # decode replays graphs with the sparse selection inside
    out = llm.generate(prompts, params)
    assert all(len(o.outputs[0].token_ids) == 24 for o in out)
