"""Speculative decoding under tensor parallelism, on the CPU over gloo: with spec=ngram, mtp and auto
(k=3) the greedy tokens at tensor_parallel_size 2 equal tensor_parallel_size 1's with the same spec mode
and with speculation off, over prompts of different lengths in chunked prefill with a queue (steps that
mix verification rows with prefill chunks); chosen and top-5 logprobs within test_tp_engine's fp32
bounds; and the speculation counters equal TP 1's (the same drafts, the same acceptances), with drafts
both accepted and rejected. A worker that skips or misplaces the commit of an accepted GDN state, reads
a verifying step's metadata wrongly, or whose MTP head shard drafts differently (or joins the
collectives in another order: a hang) breaks one of these.

The fixture is the spec preset (greedy output walks cycles, so n-gram drafts can be right) with two KV
heads, so that TP 2 divides every head count, and its MTP head fitted briefly (qv.spec.fit).
"""

from __future__ import annotations

import random

import pytest

from qv import SamplingParams
from qv.model import tiny
from qv.spec.fit import fit_mtp_head
from parallel.test_tp_engine import LOGPROB_BOUND, TOP_BOUND, close_logprob, top_logprobs
from util import assert_close

LEVERS = dict(prefix_caching=False, max_num_batched_tokens=16, max_num_seqs=3, block_size=8)
LENGTHS, MAX_TOKENS, TOP, K = (37, 3, 21), 24, 5, 3
FIT = dict(steps=60, num_seqs=12)  # a quarter of tests/spec's fit: KL ~2 (from ~800), about 1 draft in 4 accepted


@pytest.fixture(scope="module")
def spec_dir(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(tiny.PRESETS, "spec-tp", dict(tiny.PRESETS["spec"], num_key_value_heads=2))
        path = tiny.make_tiny(tmp_path_factory.mktemp("tp-spec") / "spec-tp", "spec-tp", seed=3, mtp=True)
    fit_mtp_head(path, **FIT, log=lambda *_: None)
    return str(path)


@pytest.fixture(scope="module")
def case(tiny_engine, spec_dir):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    prompts = [[rng.randrange(300) for _ in range(n)] for n in LENGTHS]
    cycle = tiny.PRESETS["spec"]["cycle"]
    lists = [list(range(c, c + cycle)) for c in rng.sample(range(4 * cycle, 15 * cycle, cycle), 2)]
    prompts.append(lists[0] * 2)  # a list the model repeats: n-gram drafts match
    # a list broken after 5 ids, then its start: once the model continues the list, n-gram drafts the
    # 4th and 5th ids and a broken one (2 accepted, then rejected)
    prompts.append(lists[1][:5] + [rng.randrange(300) for _ in range(3)] + lists[1][:2])
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)
    off, _ = generate(tiny_engine, spec_dir, prompts, params)
    return spec_dir, prompts, params, seed, off


def generate(tiny_engine, model_dir, prompts, params, **levers):
    llm = tiny_engine(model=model_dir, **LEVERS, **levers)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return outs, llm.engine.spec.stats if llm.engine.spec else None
    finally:
        llm.engine.shutdown()


@pytest.mark.timeout(300)  # a collective the ranks do not share would wait out the process group timeout
@pytest.mark.parametrize("mode", ["ngram", "mtp", "auto"])
def test_tp2_speculation_equals_tp1(tiny_engine, case, mode):
    model_dir, prompts, params, seed, off = case
    print(f"seed {seed}")
    ref, ref_stats = generate(tiny_engine, model_dir, prompts, params, spec=mode, spec_k=K)
    got, stats = generate(tiny_engine, model_dir, prompts, params, spec=mode, spec_k=K, tensor_parallel_size=2)
    errs = []
    for i, (g, r, o) in enumerate(zip(got, ref, off)):
        name, out = f"spec={mode} prompt {i} (len {len(prompts[i])}, seed {seed})", g.outputs[0].token_ids
        assert out == r.outputs[0].token_ids, f"{name}: TP 2 differs from TP 1"
        assert out == o.outputs[0].token_ids, f"{name}: TP 2 differs from speculation off"
        for j, (tok, ge, re) in enumerate(zip(out, g.outputs[0].logprobs, r.outputs[0].logprobs)):
            assert ge[tok].rank == re[tok].rank, f"{name} token {j}"
            errs.append(close_logprob(f"{name} token {j}", prompts[i] + out[:j], tok, ge[tok].logprob,
                                      re[tok].logprob, model_dir))
        assert_close(f"{name} top-{TOP} logprobs", top_logprobs(g), top_logprobs(r), TOP_BOUND)
    assert stats == ref_stats, f"spec={mode}: TP 2 drafted or accepted differently from TP 1"
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, \
        f"spec={mode}: drafts must be both accepted and rejected for the commit to be tested ({stats})"
    print(f"spec={mode} seed {seed}: {stats}; {len(errs)} logprobs, worst difference {max(errs):.1e} "
          f"(bound {LOGPROB_BOUND})")
