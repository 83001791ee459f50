"""Async scheduling (EngineConfig.async_scheduling): step N+1 is planned and launched before step
N's tokens reach the host. The same workloads, driven call by call (requests added and aborted
between engine steps), must give exactly the synchronous engine's outputs: tokens, text, finish
and stop reasons, logprobs, cached-token counts and the engine's token counters."""

from __future__ import annotations

import random

import pytest
import torch

from qv import LLM, SamplingParams
from qv.config import EngineConfig, ModelConfig
from qv.engine.build import default_model_dir
from qv.engine.sequence import PENDING
from qv.model.cache import kv_bytes_per_block


LOGPROB_ROUNDING = 1e-4  # fp32 sums over other batch shapes, carried along the KV (measured: up to 2e-5)


@pytest.fixture(scope="module")
def pair(tiny_engine):
    """One synchronous and one async engine on the embedded tiny model (shared by the plain workloads)."""
    return {mode: tiny_engine(model=None, async_scheduling=mode, max_num_seqs=6, max_num_batched_tokens=96)
            for mode in (False, True)}


def _summary(out) -> tuple:
    """(finished, cached tokens, error, per sample (index, text, ids, finish, stop, logprob structure),
    the logprob values): ids, ranks and decoded text compare exactly, the values by `_close`."""
    comps, values = [], []
    for c in out.outputs:
        entries = [sorted(entry.items()) for entry in c.logprobs] if c.logprobs is not None else None
        lps = None if entries is None else [[(tid, lp.rank, lp.decoded_token) for tid, lp in e] for e in entries]
        values += [lp.logprob for e in entries or [] for _, lp in e]
        comps.append((c.index, c.text, tuple(c.token_ids), c.finish_reason, c.stop_reason, lps))
    return (out.finished, out.num_cached_tokens, out.error, comps), values


def _drive(llm: LLM, script: dict[int, list[tuple]]) -> dict[str, tuple]:
    """Run `script` ({call index: actions before that engine call}; ("add", rid, ids, params) or
    ("abort", rid)) to the end; returns every request's final output summary."""
    eng, final, call = llm.engine, {}, 0
    last = max(script, default=0)
    while call <= last or eng.has_unfinished_requests():
        for act in script.get(call, []):
            if act[0] == "add":
                eng.add_request(*act[1:])
            else:
                out = eng.abort_request(act[1])
                if out is not None:
                    final[out.request_id] = _summary(out)
        for out in eng.step():
            assert all(PENDING not in c.token_ids for c in out.outputs), "a placeholder reached an output"
            if out.finished:
                final[out.request_id] = _summary(out)
        call += 1
        assert call < 5000
    blocks = eng.blocks
    assert blocks.num_free == blocks.num_blocks and not any(blocks.ref_counts), "blocks leaked"
    assert eng.scheduler.slots.num_free == eng.scheduler.slots.num_slots, "GDN slots leaked"
    return final


def _counters(llm: LLM) -> tuple:
    s = llm.engine.stats
    return s.prompt_tokens, s.generation_tokens, dict(s.finished), s.prefix_cache_hits, s.prompt_tokens_cached


def _same(llms: dict, script: dict, exact: bool = False) -> dict:
    """Run script on the sync and async engines; assert identical outputs and counters. Logprob values
    are bitwise equal where both engines ran the same batches (`exact`); where they did not (a request
    that arrives while a step is in flight is admitted one step later; a row that finished on a stop
    runs once more, dropped), fp32 sums over other batch shapes move them by rounding only."""
    sync, asy = llms[False], llms[True]
    before = _counters(sync), _counters(asy)
    a, b = _drive(sync, script), _drive(asy, script)
    assert a.keys() == b.keys()
    for rid in a:
        assert a[rid][0] == b[rid][0], f"request {rid}: sync {a[rid][0]} != async {b[rid][0]}"
        if exact:
            assert a[rid][1] == b[rid][1], f"request {rid}: logprobs differ"
        else:
            assert a[rid][1] == pytest.approx(b[rid][1], rel=0, abs=LOGPROB_ROUNDING), f"request {rid}: logprobs"
    after = _counters(sync), _counters(asy)
    delta = [tuple(_sub(x, y) for x, y in zip(after[i], before[i])) for i in (0, 1)]
    assert delta[0] == delta[1], f"counters differ: sync {delta[0]} != async {delta[1]}"
    return {rid: s for rid, (s, _) in a.items()}


def _sub(x, y):
    if isinstance(x, dict):
        return {k: v - y.get(k, 0) for k, v in x.items() if v - y.get(k, 0)}
    return x - y


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 300) for _ in range(n)]


def test_greedy_arrivals_at_different_steps(pair):
    rng = random.Random(1)
    script: dict[int, list] = {}
    for i in range(16):
        params = SamplingParams(temperature=0, max_tokens=rng.choice([1, 2, 7, 16, 33]), ignore_eos=i % 3 == 0)
        script.setdefault(rng.choice([0, 0, 1, 2, 3, 5, 8, 13, 21]), []).append(
            ("add", f"g{i}", _prompt(rng, rng.choice([1, 2, 15, 16, 17, 40, 130, 250])), params))
    a = _same(pair, script)
    reasons = {c[3] for s in a.values() for c in s[3]}
    assert "length" in reasons
    assert pair[True].engine.stats.async_steps > 0


def test_the_same_batches_give_bitwise_equal_logprobs(pair):
    """All requests at once, more than max_num_seqs, every end a length: sequences whose last token
    is in flight give their seats back before the next plan, so both engines run the same batches."""
    rng = random.Random(11)
    reqs = []
    for i in range(14):
        params = SamplingParams(temperature=rng.choice([0, 0.8]), seed=i, max_tokens=rng.choice([1, 3, 9, 20]),
                                ignore_eos=True, logprobs=rng.choice([0, 2]), n=rng.choice([1, 1, 2]))
        reqs.append(("add", f"b{i}", _prompt(rng, rng.choice([1, 16, 17, 90, 200])), params))
    _same(pair, {0: reqs}, exact=True)


def test_seeded_sampling_n_and_logprobs(pair):
    rng = random.Random(2)
    script = {0: [], 2: [], 4: []}
    for i in range(9):
        params = SamplingParams(temperature=rng.choice([0.6, 1.0, 1.3]), top_p=rng.choice([1.0, 0.9]),
                                top_k=rng.choice([0, 20]), min_p=rng.choice([0.0, 0.05]), seed=100 + i,
                                n=rng.choice([1, 2, 3]), max_tokens=rng.choice([5, 12, 24]),
                                logprobs=rng.choice([None, 0, 3]))
        script[[0, 2, 4][i % 3]].append(("add", f"s{i}", _prompt(rng, rng.randrange(1, 60)), params))
    # unseeded requests draw their seeds from the engine's generator in arrival order: the same in both
    script[0].append(("add", "u0", _prompt(rng, 9), SamplingParams(temperature=1.0, max_tokens=10, logprobs=2)))
    a = _same(pair, script)
    assert any(len(s[3]) == 3 for s in a.values())


def test_stops_end_requests_mid_batch(pair):
    """Stop tokens, stop strings and eos at different steps of requests that share the batch."""
    rng = random.Random(3)
    prompts = [_prompt(rng, rng.randrange(3, 50)) for _ in range(12)]
    free = pair[False].generate([{"prompt_token_ids": p} for p in prompts],
                                SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    script: dict[int, list] = {0: [], 1: []}
    for i, (p, out) in enumerate(zip(prompts, free)):
        toks, text = out.outputs[0].token_ids, out.outputs[0].text
        kind = i % 4
        if kind == 0:  # a token it will generate at position 3..12
            params = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[toks[rng.randrange(3, 12)]])
        elif kind == 1 and len(text) > 8:  # a string it will print
            j = rng.randrange(2, len(text) - 3)
            params = SamplingParams(temperature=0, max_tokens=24, stop=[text[j:j + 2]],
                                    include_stop_str_in_output=i % 8 == 1)
        elif kind == 2:  # min_tokens holds back the stop until then
            params = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[toks[1], toks[4]], min_tokens=6)
        else:  # eos wherever the model says it
            params = SamplingParams(temperature=0, max_tokens=48)
        script[i % 2].append(("add", f"t{i}", p, params))
    a = _same(pair, script)
    reasons = [c[3:5] for s in a.values() for c in s[3]]
    assert sum(1 for r, _ in reasons if r == "stop") >= 6, reasons


def test_eos_in_the_batch(pair):
    """Enough random prompts that some end on eos (2 of 384 tokens) while others keep going."""
    rng = random.Random(4)
    script = {k: [("add", f"e{k}-{i}", _prompt(rng, rng.randrange(1, 30)), SamplingParams(temperature=0, max_tokens=64))
                  for i in range(6)] for k in (0, 3, 7)}
    a = _same(pair, script)
    eos = [rid for rid, s in a.items() if s[3][0][3] == "stop" and s[3][0][4] is None]
    assert eos, "no request ended on eos: pick another seed"
    assert any(s[3][0][3] == "length" for s in a.values())


def test_abort_mid_flight(pair):
    rng = random.Random(5)
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    script = {0: [("add", f"a{i}", _prompt(rng, 20 + i), greedy) for i in range(5)],
              3: [("abort", "a1")], 6: [("abort", "a3"), ("abort", "a4")], 7: [("abort", "a3")]}
    a = _same(pair, script)
    assert [a[f"a{i}"][3][0][3] for i in range(5)] == ["length", "abort", "length", "abort", "abort"]
    assert 0 < len(a["a1"][3][0][2]) < len(a["a3"][3][0][2]) < 30


def test_penalties_fall_back_and_match(pair):
    rng = random.Random(6)
    script = {0: [("add", "p0", _prompt(rng, 12), SamplingParams(temperature=0, max_tokens=20,
                                                                repetition_penalty=1.3, presence_penalty=0.5)),
                  ("add", "p1", _prompt(rng, 7), SamplingParams(temperature=0.9, seed=3, max_tokens=30,
                                                               frequency_penalty=0.7))],
              2: [("add", "p2", _prompt(rng, 30), SamplingParams(temperature=0, max_tokens=40))]}
    _same(pair, script)


def test_prefix_cache_hits(tiny_engine):
    """Turn two resumes from turn one's blocks and snapshot: the same hits, counts and tokens."""
    llms = {m: tiny_engine(model=None, async_scheduling=m, block_size=16, gdn_snapshot_interval=32) for m in (False,
                                                                                                              True)}
    rng = random.Random(7)
    turn1 = _prompt(rng, 70)
    params = SamplingParams(temperature=0, max_tokens=26, ignore_eos=True)
    a = _same(llms, {0: [("add", "c1", turn1, params), ("add", "c1b", turn1[:40], params)]})
    turn2 = turn1 + list(a["c1"][3][0][2]) + _prompt(rng, 15)
    a = _same(llms, {0: [("add", "c2", turn2, params)], 2: [("add", "c3", turn2[:67] + [5, 6], params)]})
    assert a["c2"][1] == 64 and a["c3"][1] == 64


def test_preemption_under_a_small_cache(tiny_engine):
    block = 16
    budget = 12 * kv_bytes_per_block(ModelConfig.from_dir(default_model_dir()), block, torch.float32)
    llms = {m: tiny_engine(model=None, async_scheduling=m, block_size=block, kv_cache_bytes=budget,
                           max_num_batched_tokens=64,
                   prefix_caching=False) for m in (False, True)}
    rng = random.Random(8)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    script = {0: [("add", f"q{i}", _prompt(rng, rng.randrange(20, 50)), params) for i in range(6)],
              4: [("add", f"q{i}", _prompt(rng, rng.randrange(20, 50)), params) for i in range(6, 8)]}
    sync, asy = _drive(llms[False], script), _drive(llms[True], script)
    assert llms[False].engine.scheduler.num_preemptions > 0 and llms[True].engine.scheduler.num_preemptions > 0
    # preemption points may differ (the plan that could preempt waits for the tokens): the outputs may not
    assert {k: v[0][3][0][2:4] for k, v in sync.items()} == {k: v[0][3][0][2:4] for k, v in asy.items()}
    assert llms[True].engine.stats.async_steps > 0


def test_max_model_len(tiny_engine):
    llms = {m: tiny_engine(model=None, async_scheduling=m, max_model_len=48) for m in (False, True)}
    rng = random.Random(9)
    script = {0: [("add", "m0", _prompt(rng, 30), SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)),
                  ("add", "m1", _prompt(rng, 40), SamplingParams(temperature=0.8, seed=1, max_tokens=None,
                                                                ignore_eos=True))],
              1: [("add", "m2", _prompt(rng, 47), SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))]}
    a = _same(llms, script)
    assert [len(a[r][3][0][2]) for r in ("m0", "m1", "m2")] == [18, 8, 1]
    assert all(a[r][3][0][3] == "length" for r in a)


def test_the_next_step_launches_before_the_last_is_applied(pair):
    """Async: step N+1 is launched (runner.execute) before step N is collected; sync: never."""
    rng = random.Random(10)
    prompts = [{"prompt_token_ids": _prompt(rng, 10 + i)} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for mode, llm in pair.items():
        runner, events = llm.engine.runner, []
        execute, collect = runner.execute, runner.collect
        runner.execute = lambda plan: (h := execute(plan), events.append(("launch", id(h))))[0]
        runner.collect = lambda h: (events.append(("collect", id(h))), collect(h))[1]
        try:
            before = llm.engine.stats.async_steps
            outs = llm.generate(prompts, params)
        finally:
            del runner.execute, runner.collect
        assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
        kinds = [k for k, _ in events]
        if mode:  # launch 1, launch 2, collect 1, launch 3, collect 2, ..., collect 8
            assert kinds == ["launch", "launch"] + ["collect", "launch"] * 6 + ["collect", "collect"]
            assert [h for k, h in events if k == "collect"] == [h for k, h in events if k == "launch"]
            assert llm.engine.stats.async_steps - before == 7
        else:
            assert kinds == ["launch", "collect"] * 8


def test_the_lever_and_speculation_turn_it_off(tiny_engine):
    assert EngineConfig.from_env({}).async_scheduling is True
    assert EngineConfig.from_env({"QV_ASYNC_SCHEDULING": "0"}).async_scheduling is False
    llm = tiny_engine(model=None, spec="ngram")  # each step needs the last one's drafts: always synchronous
    out = llm.generate({"prompt_token_ids": [5, 6, 7, 5, 6, 7, 5, 6]}, SamplingParams(temperature=0, max_tokens=12))
    assert len(out[0].outputs[0].token_ids) == 12 and llm.engine.stats.async_steps == 0


@pytest.mark.gpu
def test_gpu_graphs_async_equals_sync(tiny_engine):
    """On the GPU, with decode CUDA graphs: the pending ids reach the graphs' static inputs in stream
    order (filled after the upload, before the replay's copy). Length ends only, so both engines run
    the same batches (bf16 sums over other batch shapes could flip a near-tie)."""
    llms = {m: tiny_engine(model=None, device="cuda", async_scheduling=m, max_num_seqs=8, kv_cache_bytes=256 << 20)
            for m in (False, True)}
    assert llms[True].engine.runner.graphs is not None
    rng = random.Random(12)
    reqs = [("add", f"gpu{i}", _prompt(rng, rng.choice([1, 16, 70, 300])),
             SamplingParams(temperature=rng.choice([0, 0.8]), seed=i, max_tokens=rng.choice([1, 5, 40]),
                            ignore_eos=True, logprobs=1)) for i in range(20)]
    a, b = _drive(llms[False], {0: reqs}), _drive(llms[True], {0: reqs})
    for rid in a:
        assert a[rid][0] == b[rid][0], rid
        assert a[rid][1] == pytest.approx(b[rid][1], rel=0, abs=1e-5), rid
    assert llms[True].engine.stats.async_steps > 0
