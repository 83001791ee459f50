"""The scheduling policy that keeps chats fast beside long prefills: decodes go first in every step,
and while anything decodes a long prefill takes at most `long_prefill_token_threshold` tokens and at
most `max_long_partial_prefills` of them run in one step. Alone, a long prefill takes the budget."""

from __future__ import annotations

import random

from qv import LLM, SamplingParams

BUDGET, THRESHOLD = 256, 48


def _recording(llm: LLM) -> tuple[list, list]:
    """Every step plan the engine's scheduler makes, as [(sequence, tokens, decoding?, tokens left)], and
    per step the decoding sequences it left out."""
    sched, plans, waiting_decodes = llm.engine.scheduler, [], []
    schedule = sched.schedule

    def spy():
        before = {s: s.num_tokens - s.num_computed_tokens for s in [*sched.running, *sched.waiting]}
        decoding = {s for s in sched.running if before[s] <= 1}
        plan = schedule()
        plans.append([(s, n, before.get(s, n) <= 1, before.get(s, n)) for s, n in plan.scheduled])
        waiting_decodes.append(decoding - {s for s, _ in plan.scheduled})
        return plan

    sched.schedule = spy
    return plans, waiting_decodes


def _llm(tiny_engine, **levers) -> LLM:
    return tiny_engine(max_num_batched_tokens=BUDGET, long_prefill_token_threshold=THRESHOLD,
                       async_scheduling=False, prefix_caching=False, max_step_ms=0, **levers)


def test_long_prefills_take_a_bounded_share_while_chats_decode(tiny_engine):
    rng = random.Random(0)
    llm = _llm(tiny_engine)
    plans, unplanned_decodes = _recording(llm)
    eng = llm.engine
    chat = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i in range(3):
        eng.add_request(f"chat-{i}", [rng.randrange(3, 300) for _ in range(rng.randrange(5, 20))], chat)
    while not all(s.num_computed_tokens >= s.num_prompt_tokens for s in eng.scheduler.running) or \
            len(eng.scheduler.running) < 3:
        eng.step()
    longs = [[rng.randrange(3, 300) for _ in range(rng.randrange(300, 700))] for _ in range(3)]
    for i, ids in enumerate(longs):
        eng.add_request(f"long-{i}", ids, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    done, start = set(), len(plans)
    while len(done) < 6:
        done |= {o.request_id for o in eng.step() if o.finished}
    shared = [p for p in plans[start:] if any(dec for _, _, dec, _ in p)]
    assert shared, "no step had decodes beside the long prefills"
    for plan in shared:
        long_rows = [(n, left) for _, n, dec, left in plan if not dec and left > THRESHOLD]
        assert len(long_rows) <= 1, f"{len(long_rows)} long prefills shared a step with decodes"
        assert all(n <= THRESHOLD for n, _ in long_rows), long_rows
    assert not any(unplanned_decodes), "a decoding sequence was left out of a step"
    for plan in plans[start:]:
        decodes = [i for i, (_, _, dec, _) in enumerate(plan) if dec]
        prefills = [i for i, (_, _, dec, _) in enumerate(plan) if not dec]
        assert not decodes or not prefills or max(decodes) < min(prefills), "a prefill was planned before a decode"


def test_chats_keep_decoding_every_step_beside_long_prefills(tiny_engine):
    llm = _llm(tiny_engine)
    eng = llm.engine
    for i in range(2):  # the long prefills are ahead of the chat in the queue
        eng.add_request(f"long-{i}", [9 + i] * 900, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    eng.step()
    eng.add_request("chat", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    gaps, steps_since, seen = [], 0, 0
    while eng.has_unfinished_requests():
        outs = {o.request_id: o for o in eng.step()}
        steps_since += 1
        chat = outs.get("chat")
        if chat is not None and len(chat.outputs[0].token_ids) > seen:
            seen = len(chat.outputs[0].token_ids)
            gaps.append(steps_since)
            steps_since = 0
    assert seen == 60
    assert max(gaps) == 1, f"the chat waited {max(gaps)} steps for a token"
    assert eng.scheduler.num_preemptions == 0


def test_a_long_prefill_alone_takes_the_whole_budget(tiny_engine):
    llm = _llm(tiny_engine)
    plans, _ = _recording(llm)
    llm.generate({"prompt_token_ids": [7] * 700}, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert plans[0][0][1] == BUDGET and plans[1][0][1] == BUDGET


def test_outputs_equal_without_the_share(tiny_engine):
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 300) for _ in range(n)]} for n in (8, 12, 500, 650, 30)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    shared = _llm(tiny_engine).generate(prompts, params)
    whole = _llm(tiny_engine, max_long_partial_prefills=8).generate(prompts, params)
    wide = tiny_engine(max_num_batched_tokens=BUDGET, long_prefill_token_threshold=100000,
                       async_scheduling=False, prefix_caching=False).generate(prompts, params)
    for a, b, c in zip(shared, whole, wide):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
