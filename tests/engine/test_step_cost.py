"""Steps sized to a latency target (max_step_ms): the step cost model's fit, and the scheduler's step
plans checked against the model it plans with. No timing assertions: the plans are checked against the
model's predictions, not against a clock."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from qv import LLM, SamplingParams
from qv.engine.kv_cache import KVBlockPool
from qv.engine.scheduler import Scheduler
from qv.engine.sequence import Sequence
from qv.engine.state_pool import GDNStatePool
from qv.engine.step_cost import DEFAULT_PRIOR, MIN_PROMPT_SHARE, StepCost, StepCostModel, plan_prompt_tokens

COST = StepCost(fixed_ms=10.0, decode_row_ms=0.5, prompt_row_ms=0.05, clef_row_ms=0.1)
BUDGET = 2048


def _seq(i: int, n: int, clef: bool = False) -> Sequence:
    return Sequence(i, f"r{i}", 0, [3 + i % 50] * n, SamplingParams(), 10_000, 0, None, i,
                    cache_salt=f"clef:{i}" if clef else None)


def _scheduler(target_ms: float) -> Scheduler:
    return Scheduler(KVBlockPool(4096, 16), GDNStatePool(64), max_num_seqs=32, max_num_batched_tokens=BUDGET,
                     max_step_ms=target_ms, step_cost=StepCostModel(prior=COST))


def _run(sched: Scheduler):
    """Plan one step and apply it as the engine would: computed tokens advance, caught-up sequences sample
    a token, caught-up records finish. Returns [(seq, tokens, decoding?, prompt tokens left)]."""
    before = {s: s.num_tokens - s.num_computed_tokens for s in [*sched.running, *sched.waiting]}
    plan = sched.schedule()
    rows = [(s, n, before[s] <= 1, before[s]) for s, n in plan.scheduled]
    for s, n in plan.scheduled:
        s.num_computed_tokens += n
        if s.num_computed_tokens >= s.num_tokens:
            if s.cache_salt:
                sched.finish(s, "stop")
            else:
                s.output_token_ids.append(7)
    return rows


def _predicted(rows) -> float:
    dec = sum(n for _, n, d, _ in rows if d)
    clef = sum(n for s, n, d, _ in rows if not d and s.cache_salt)
    return COST.predict(dec, sum(n for _, n, d, _ in rows if not d) - clef, clef)


def _start_chats(sched: Scheduler, count: int) -> None:
    for i in range(count):
        sched.add(_seq(i, 8))
    first = _run(sched)  # nothing decodes yet: every chat prompt whole in one step
    assert sorted(n for _, n, _, _ in first) == [8] * count


@pytest.mark.parametrize("target_ms", [30.0, 60.0])
def test_steps_with_decodes_stay_under_the_target_and_every_prompt_progresses(target_ms):
    rng = random.Random(5)
    sched = _scheduler(target_ms)
    _start_chats(sched, 6)
    prompts = [_seq(100 + i, rng.randrange(2000, 4000), clef=True) for i in range(3)]
    prompts += [_seq(200 + i, rng.randrange(10, 5000)) for i in range(3)]
    for s in prompts:
        sched.add(s)
    steps = 0
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in prompts):
        steps += 1
        assert steps < 2000, "the prompts stopped progressing"
        waiting_prompts = {s for s in prompts if s.num_computed_tokens < s.num_prompt_tokens}
        rows = _run(sched)
        got = {s: n for s, n, dec, _ in rows if not dec}  # a prompt with one token left is a decode row
        assert sum(s not in prompts for s, _, _, _ in rows) == 6, "a decoding chat was left out of a step"
        assert {s for s, n, _, _ in rows if n > 0} >= waiting_prompts, "a waiting prompt got no tokens this step"
        assert _predicted(rows) <= target_ms + 1e-9, (steps, _predicted(rows), got)
        # the same count for each, or all a prompt had left; and no more would have fit
        left = {s: l for s, _, dec, l in rows if not dec}
        share = max(got.values())
        assert all(n == share or n == left[s] for s, n in got.items()), got
        grown = [(s, n + 1, False, 0) for s, n in got.items() if n < left[s]]
        more = [r for r in rows if r[2]] + grown + [(s, n, False, 0) for s, n in got.items() if n >= left[s]]
        assert not grown or _predicted(more) > target_ms or sum(n for _, n, _, _ in more) > BUDGET
    assert steps > 1, "the prompts were not split under the target"


def test_decodes_over_the_target_still_leave_every_prompt_a_floor_share():
    sched = _scheduler(5.0)  # below the fixed cost alone
    _start_chats(sched, 4)
    record, chat = _seq(100, 1000, clef=True), _seq(101, 700)
    sched.add(record)
    sched.add(chat)
    for _ in range(3):
        got = {s: n for s, n, dec, _ in _run(sched) if not dec}
        assert got == {record: MIN_PROMPT_SHARE, chat: MIN_PROMPT_SHARE}


@pytest.mark.parametrize("ratio, chats", [(2.0, 6), (2.0, 24), (3.5, 12)])
def test_the_ratio_target_scales_with_the_decode_only_step(ratio, chats):
    """max_step_decode_ratio: each step with decodes is predicted within ratio x the same decode rows alone,
    so more decoding chats leave the prompts no less room in relative terms; one more token each would pass it."""
    sched = Scheduler(KVBlockPool(4096, 16), GDNStatePool(64), max_num_seqs=64, max_num_batched_tokens=BUDGET,
                      max_step_decode_ratio=ratio, step_cost=StepCostModel(prior=COST))
    _start_chats(sched, chats)
    record, chat = _seq(100, 3000, clef=True), _seq(101, 2500)
    sched.add(record)
    sched.add(chat)
    for _ in range(4):
        rows = _run(sched)
        decodes = sum(n for _, n, dec, _ in rows if dec)
        assert decodes == chats
        got = {s: n for s, n, dec, _ in rows if not dec}
        assert set(got) == {record, chat} and len(set(got.values())) == 1
        target = ratio * COST.predict(decodes)
        assert _predicted(rows) <= target + 1e-9
        more = [r if r[2] else (r[0], r[1] + 1, False, 0) for r in rows]
        assert _predicted(more) > target


def test_both_forms_of_the_target_are_refused_together():
    from qv.config import ConfigError, EngineConfig
    with pytest.raises(ConfigError, match="max_step_ms and max_step_decode_ratio"):
        EngineConfig(max_step_ms=30, max_step_decode_ratio=2)
    assert EngineConfig(max_step_decode_ratio=2).max_step_decode_ratio == 2.0
    # a scheduler given both (a ratio the user did not set, under a nonzero default) plans to max_step_ms
    sched = Scheduler(KVBlockPool(4096, 16), GDNStatePool(64), max_num_seqs=32, max_num_batched_tokens=BUDGET,
                      max_step_ms=30.0, max_step_decode_ratio=10.0, step_cost=StepCostModel(prior=COST))
    _start_chats(sched, 6)
    sched.add(_seq(100, 3000, clef=True))
    rows = _run(sched)
    assert _predicted(rows) <= 30.0 < _predicted([r if r[2] else (r[0], r[1] + 1, False, 0) for r in rows])


def test_nothing_decoding_takes_the_whole_budget():
    sched = _scheduler(30.0)
    sched.add(_seq(1, 5000, clef=True))
    sched.add(_seq(2, 5000))
    rows = _run(sched)
    assert sum(n for _, n, _, _ in rows) == BUDGET


def test_plan_prompt_tokens_shares_and_bounds():
    cost = StepCost(fixed_ms=0.0, decode_row_ms=1.0, prompt_row_ms=1.0, clef_row_ms=2.0)
    # 100 ms spare after 4 decode rows: t + 2t + min(5, t) = 100 -> t = 31 (31 + 62 + 5 = 98)
    assert plan_prompt_tokens(cost, 104.0, 4, [(500, False), (500, True), (5, False)], 4096) == [31, 31, 5]
    assert plan_prompt_tokens(cost, 1e6, 0, [(500, False), (900, False)], 600) == [300, 300]  # the token budget
    assert plan_prompt_tokens(cost, 0.0, 4, [(500, False), (3, True)], 4096) == [MIN_PROMPT_SHARE, 3]
    assert plan_prompt_tokens(cost, 0.0, 4, [(500, False)] * 3, 2) == [1, 1, 0]  # more prompts than tokens
    assert plan_prompt_tokens(cost, 10.0, 1, [], 4096) == []


def test_plan_prompt_tokens_fills_the_rows_up_to_the_graphs_bucket():
    cost = StepCost(fixed_ms=0.0, decode_row_ms=1.0, prompt_row_ms=1.0, clef_row_ms=2.0)
    prompts = [(500, False), (500, True), (5, False)]
    buckets = (16, 32, 64, 96, 128)
    # 4 + 31 + 31 + 5 = 71 rows planned: the 96-row bucket's 25 spare rows go to the prompts with tokens left
    tokens = plan_prompt_tokens(cost, 104.0, 4, prompts, 4096, row_buckets=buckets)
    assert tokens == [44, 43, 5] and 4 + sum(tokens) == 96
    assert plan_prompt_tokens(cost, 104.0, 4, prompts, 80, row_buckets=buckets) == [38, 37, 5]  # within the budget
    assert plan_prompt_tokens(cost, 1e6, 4, [(20, False), (30, True)], 4096, row_buckets=buckets) == [20, 30]  # all left
    assert plan_prompt_tokens(cost, 104.0, 4, prompts, 4096, row_buckets=(16, 32, 64)) == [31, 31, 5]  # past the last
    assert plan_prompt_tokens(cost, 10.0, 4, [], 4096, row_buckets=buckets) == []


@pytest.mark.parametrize("jump_ms", [0.0, 4.0])
def test_the_cost_model_learns_the_step_times_it_sees(jump_ms):
    rng = random.Random(11)
    truth = StepCost(fixed_ms=3.0, decode_row_ms=0.2, prompt_row_ms=0.02, clef_row_ms=0.04, prompt_step_ms=jump_ms)
    model = StepCostModel()  # the 27B/H100 prior, far from this "device"
    for _ in range(400):
        rows = (rng.randrange(0, 32), rng.choice([0, rng.randrange(1, 2048)]), rng.choice([0, rng.randrange(1, 2048)]))
        model.observe(*rows, truth.predict(*rows) * rng.uniform(0.98, 1.02))
    for rows in [(6, 0, 0), (6, 16, 0), (6, 300, 0), (6, 0, 300), (1, 2048, 0), (32, 0, 2048)]:
        assert model.cost.predict(*rows) == pytest.approx(truth.predict(*rows), rel=0.05), rows
    model.observe(6, 300, 0, 1e6)  # a stall (compile, GC) counts as at most a few predictions
    assert model.cost.predict(6, 300, 0) < 2 * truth.predict(6, 300, 0)


def test_the_engine_plans_with_the_target_and_feeds_its_step_times(tiny_dirs):
    """With a target below any step, prompts beside decodes go MIN_PROMPT_SHARE tokens at a time; the
    greedy tokens are those of the engine without a target."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = {"chat": [5, 6, 7, 8], "long": [9, 10, 11] * 40}
    outs = {}
    for target in (0.0, 1e-3):
        llm = LLM(model=str(tiny_dirs("tiny")), max_step_ms=target, prefix_caching=False)
        eng, sched, plans = llm.engine, llm.engine.scheduler, []
        schedule = sched.schedule

        def spy():
            decoding = {s for s in sched.running if s.num_tokens - s.num_computed_tokens <= 1}
            plan = schedule()
            plans.append([(n, s in decoding) for s, n in plan.scheduled])
            return plan

        sched.schedule = spy
        eng.add_request("chat", prompts["chat"], params)
        eng.step()
        eng.step()
        eng.add_request("long", prompts["long"], params)
        done = {}
        for _ in range(500):
            done |= {o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished}
            if len(done) == 2:
                break
        outs[target] = done
        mixed = [p for p in plans if any(d for _, d in p) and any(not d for _, d in p)]
        assert eng.step_timer.model.num_steps >= len(plans) - 2
        if target:
            assert mixed and all(n <= MIN_PROMPT_SHARE for p in mixed for n, d in p if not d), mixed
    assert outs[0.0] == outs[1e-3] and len(outs[0.0]) == 2


@pytest.mark.parametrize("truth", [
    StepCost(fixed_ms=14.0, decode_row_ms=0.05, prompt_row_ms=0.02, clef_row_ms=0.03, prompt_step_ms=12.0),
    StepCost(fixed_ms=3.0, decode_row_ms=0.2, prompt_row_ms=0.01, clef_row_ms=0.02, prompt_step_ms=1.0),
])
def test_planning_from_its_own_steps_meets_a_ratio_target_over_a_jump(truth):
    """A step with prompt rows costs a fixed jump over a decode-only step (eager attention between graph pieces).
    The engine plans each step from the model and learns from the step it planned, so its steps vary little:
    6 decodes beside a record, one decode-only step in 8. The planned record rows settle within 10% of what the
    truth allows under 2.5x the decode-only step, and a following stretch of 600 record steps with no decode-only
    step keeps the decode-only step the target multiplies. Seeded noise of 3%."""
    rng = random.Random(5)
    model, decodes = StepCostModel(), 6
    ideal = (1.5 * truth.predict(decodes) - truth.prompt_step_ms) / truth.clef_row_ms
    for step in range(1000):
        if step < 400 and step % 8 == 0:
            model.observe(decodes, 0, 0, truth.predict(decodes) * rng.uniform(0.97, 1.03))
            continue
        target = 2.5 * model.cost.predict(decodes)
        tokens = plan_prompt_tokens(model.cost, target, decodes, [(10**6, True)], 8192)[0]
        model.observe(decodes, 0, tokens, truth.predict(decodes, 0, tokens) * rng.uniform(0.97, 1.03))
        if step in (399, 999):
            assert tokens == pytest.approx(ideal, rel=0.1), (step, model.cost)
            assert model.cost.predict(decodes) == pytest.approx(truth.predict(decodes), rel=0.05), (step, model.cost)



def test_small_steps_stay_within_the_linears_few_row_edge():
    """Past row_limit (64 on sm_90: the GPTQ linear dequantizes each whole weight ahead of cuBLAS) a step costs
    wide_step_ms more. Floor shares that would carry a step past it shrink to fit (a token each at least); a
    step past it is planned only where it fits the target, jump included, with more tokens; the graphs' buckets
    are filled up to the edge, not past it."""
    cost = StepCost(fixed_ms=0.0, decode_row_ms=1.0, prompt_row_ms=1.0, clef_row_ms=1.0, wide_step_ms=30.0,
                    row_limit=64)
    records = [(1000, True)] * 4
    # 6 decodes, a target under any step with prompt rows: 4 x 16 floor shares would make 70 rows; 4 x 14 fit
    assert plan_prompt_tokens(cost, 0.0, 6, records, 8192) == [14] * 4
    assert plan_prompt_tokens(cost, 0.0, 6, records, 8192, row_buckets=(16, 32, 48, 96)) == [11, 11, 10, 10]
    assert plan_prompt_tokens(cost, 0.0, 62, records, 8192) == [1, 1, 1, 1]  # more prompts than rows left
    assert plan_prompt_tokens(cost, 0.0, 70, records, 8192) == [16] * 4  # the decodes are past it already
    # under the edge 56 rows at most; past it (6 + 30 + 4 x 40 = 196 ms) 160: the larger
    assert plan_prompt_tokens(cost, 196.0, 6, records, 8192) == [40] * 4
    assert plan_prompt_tokens(cost, 80.0, 6, records, 8192) == [14] * 4  # past it 11 each would fit: not the floor
    assert plan_prompt_tokens(replace(cost, row_limit=None), 0.0, 6, records, 8192) == [16] * 4  # no edge


def test_the_cost_model_learns_the_jump_past_the_row_limit():
    """From a prior jump of 5 ms to the truth's 30 (the prior's pull leaves it within 15%); seeded 2% noise."""
    rng = random.Random(12)
    truth = StepCost(fixed_ms=14.0, decode_row_ms=0.05, prompt_row_ms=0.03, clef_row_ms=0.05, prompt_step_ms=3.0,
                     wide_step_ms=30.0, row_limit=64)
    model = StepCostModel(prior=replace(DEFAULT_PRIOR, wide_step_ms=5.0), row_limit=64)
    for step in range(400):  # one decode-only step in 4, as chats beside records and between them
        d = rng.randrange(1, 16)
        rows = (d, 0, 0 if step % 4 == 0 else rng.choice([rng.randrange(1, 64 - d), rng.randrange(64, 1024)]))
        model.observe(*rows, truth.predict(*rows) * rng.uniform(0.98, 1.02))
    assert model.cost.row_limit == 64 and model.cost.wide_step_ms == pytest.approx(30.0, rel=0.15), model.cost
    for rows in [(6, 0, 0), (6, 0, 58), (6, 0, 59), (6, 0, 300), (1, 0, 1000)]:
        assert model.cost.predict(*rows) == pytest.approx(truth.predict(*rows), rel=0.08), rows


def test_planning_from_its_own_steps_keeps_mixed_steps_within_the_row_limit():
    """The 27B on an H100 as profiled: a step past 64 rows costs ~30 ms more (the chunked dequantization). 6 decodes
    beside 4 records under 2.5x the decode-only step, planned from the model and learned from the steps planned
    (one decode-only step in 8), settle on steps of at most 64 rows that the truth puts under the target; with no
    edge the 16-token floor makes 70 rows, each step past the target. Seeded noise of 3%."""
    truth = StepCost(fixed_ms=13.0, decode_row_ms=0.15, prompt_row_ms=0.05, clef_row_ms=0.08, prompt_step_ms=5.0,
                     wide_step_ms=30.0, row_limit=64)
    for row_limit in (64, None):
        rng, model, decodes = random.Random(6), StepCostModel(row_limit=row_limit), 6
        for step in range(400):
            if step % 8 == 0:
                model.observe(decodes, 0, 0, truth.predict(decodes) * rng.uniform(0.97, 1.03))
                continue
            target = 2.5 * model.cost.predict(decodes)
            tokens = plan_prompt_tokens(model.cost, target, decodes, [(10**6, True)] * 4, 8192)
            ms = truth.predict(decodes, 0, sum(tokens))
            model.observe(decodes, 0, sum(tokens), ms * rng.uniform(0.97, 1.03))
        if row_limit:
            assert decodes + sum(tokens) <= 64 and ms <= 2.5 * truth.predict(decodes), (tokens, ms, model.cost)
        else:
            assert tokens == [MIN_PROMPT_SHARE] * 4 and ms > 2.5 * truth.predict(decodes), (tokens, ms, model.cost)
