"""vLLM's priority scheduling policy (`scheduling_policy` priority): the queue in (priority, arrival)
order, lower first; under KV pressure the lowest priority (newest among equals) is preempted, and a
preempted sequence goes back to its place by rank, not to the front. fcfs keeps its order (the
newest preempted, back at the front). The engine refuses a priority other than 0 under fcfs, with
vLLM's words."""

from __future__ import annotations

import random

import pytest

from qv import SamplingParams
from qv.engine.kv_cache import KVBlockPool
from qv.engine.request import InvalidFieldError
from qv.engine.scheduler import Scheduler, StepPlan
from qv.engine.sequence import Sequence
from qv.engine.state_pool import GDNStatePool

BLOCK = 4


def _seq(i: int, priority: int, prompt: int = 6) -> Sequence:
    return Sequence(i, f"r{i}", 0, [3 + i] * prompt, SamplingParams(), 10_000, 0, None, i, priority=priority)


def _step(sched: Scheduler):
    """Plan one step and apply it as the engine would (a caught-up sequence samples a token)."""
    plan = sched.schedule()
    for s, n in plan.scheduled:
        s.num_computed_tokens += n
        if s.num_computed_tokens >= s.num_tokens:
            s.output_token_ids.append(7)
    return plan


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_queue_is_served_by_priority_then_arrival(seed):
    rng = random.Random(seed)
    priorities = [rng.randrange(-2, 3) for _ in range(11)]
    sched = Scheduler(KVBlockPool(4096, BLOCK), GDNStatePool(64), max_num_seqs=1, max_num_batched_tokens=64,
                      policy="priority")
    seqs = [_seq(i, p) for i, p in enumerate(priorities)]
    for s in seqs:
        sched.add(s)
    served = []
    while sched.has_work():
        plan = _step(sched)
        for s, _ in plan.scheduled:
            if s not in served:
                served.append(s)
            sched.finish(s, "stop")  # one step each: the next one is admitted on the next step
    assert served == sorted(seqs, key=lambda s: (s.priority, s.arrival_order))
    fcfs = Scheduler(KVBlockPool(4096, BLOCK), GDNStatePool(64), max_num_seqs=1, max_num_batched_tokens=64)
    for s in [_seq(i, 0) for i in range(5)]:
        fcfs.add(s)
    assert [s.seq_id for s in fcfs.waiting] == list(range(5))


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_preemption_takes_the_lowest_priority(policy):
    """The least urgent sequence starts first and holds its blocks; two more urgent ones join, and
    growth runs the pool out: under priority the oldest (least urgent) one is preempted, under fcfs
    the newest; the preempted one waits ahead of nothing more urgent."""
    sched = Scheduler(KVBlockPool(8, BLOCK), GDNStatePool(8), max_num_seqs=3, max_num_batched_tokens=64, policy=policy)
    low, mid, high = _seq(0, 5), _seq(1, 1), _seq(2, -1)
    sched.add(low)
    _step(sched)
    sched.add(mid)
    sched.add(high)
    preempted = []
    for _ in range(12):
        preempted += _step(sched).preempted
        if preempted:
            break
    assert preempted, "the pool was meant to run out"
    assert len({id(s) for s in (low, mid, high)} & {id(s) for s in [*sched.running, *preempted]}) == 3
    if policy == "priority":
        assert preempted == [low] and sched.waiting[0] is low
    else:
        assert preempted[0] is high and sched.waiting[0] is high  # the newest


def test_a_preempted_sequence_goes_back_by_rank():
    sched = Scheduler(KVBlockPool(4096, BLOCK), GDNStatePool(8), max_num_seqs=1, max_num_batched_tokens=64,
                      policy="priority")
    first = _seq(0, 1)
    sched.add(first)
    _step(sched)
    for s in (_seq(1, 0), _seq(2, 1), _seq(3, 2)):
        sched.add(s)
    sched._preempt(first, StepPlan())
    assert [(s.priority, s.seq_id) for s in sched.waiting] == [(0, 1), (1, 0), (1, 2), (2, 3)]


def test_the_engine_refuses_priority_under_fcfs(tiny_engine, tiny_dirs):
    model_dir = str(tiny_dirs("tiny"))
    llm = tiny_engine(model=model_dir)
    with pytest.raises(InvalidFieldError, match="Got priority 3 but Priority scheduling is not enabled") as err:
        llm.engine.add_request("p", [1, 2, 3], SamplingParams(max_tokens=2), priority=3)
    assert err.value.param == "priority"


def test_priority_runs_urgent_requests_first_in_the_engine(tiny_engine, tiny_dirs):
    """Four requests queued at once with one seat: they finish in priority order, and each one's greedy
    tokens equal its run alone."""
    model_dir = str(tiny_dirs("tiny"))
    llm = tiny_engine(model=model_dir, scheduling_policy="priority", max_num_seqs=1)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = {"a": ([5, 6, 7], 3), "b": ([8, 9], 0), "c": ([10, 11, 12, 13], 2), "d": ([14], 0)}
    for rid, (ids, priority) in prompts.items():
        engine.add_request(rid, ids, params, priority=priority)
    order, tokens = [], {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                order.append(out.request_id)
                tokens[out.request_id] = out.outputs[0].token_ids
    assert order == ["b", "d", "c", "a"]
    alone = llm.generate([{"prompt_token_ids": ids} for ids, _ in prompts.values()], params)
    assert [list(o.outputs[0].token_ids) for o in alone] == [list(tokens[r]) for r in prompts]


def test_mixed_priorities_in_one_batch_keep_each_requests_tokens(tiny_engine, tiny_dirs):
    """Six requests of mixed priorities and prompt lengths share steps (chunked prefills beside decodes,
    the batch ordered by priority): each one's greedy tokens equal the fcfs engine's."""
    model_dir = str(tiny_dirs("tiny"))
    rng = random.Random(5)
    prompts = [[rng.randrange(300) for _ in range(rng.randrange(3, 40))] for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    fcfs = tiny_engine(model=model_dir, max_num_batched_tokens=24)
    expected = [list(o.outputs[0].token_ids) for o in fcfs.generate([{"prompt_token_ids": p} for p in prompts],
                                                                    params)]
    engine = tiny_engine(model=model_dir, scheduling_policy="priority", max_num_batched_tokens=24).engine
    for k, p in enumerate(prompts):
        engine.add_request(f"m{k}", p, params, priority=rng.randrange(-3, 4))
    got = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = list(out.outputs[0].token_ids)
    assert [got[f"m{k}"] for k in range(6)] == expected
