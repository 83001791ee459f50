"""Features plug into the step loop through StepFeature alone: the engine calls each hook of every
feature it holds, in order, and a feature that holds the next step keeps async scheduling off."""

from __future__ import annotations

from qv import SamplingParams
from qv.engine.step_feature import StepFeature


class _Recorder(StepFeature):
    def __init__(self, calls: list, hold: bool):
        self.calls, self.hold, self.queued = calls, hold, 0

    def before_plan(self, scheduler):
        self.calls.append("before_plan")
        return []

    def fit_plan(self, plan):
        self.calls.append(("fit_plan", len(plan.scheduled)))

    def after_forward(self, scheduled, scheduler):
        self.calls.append(("after_forward", len(scheduled)))
        return []

    def holds_next_step(self, scheduler):
        return self.hold

    @property
    def num_queued(self):
        return self.queued


def test_hooks_run_each_step_in_order_and_holding_keeps_steps_synchronous(tiny_engine):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 10]}]
    for hold in (False, True):
        llm = tiny_engine(model=None, async_scheduling=True, prefix_caching=False)
        calls = []
        llm.engine.features.append(_Recorder(calls, hold))
        out = llm.generate(prompts, params)
        assert [len(o.outputs[0].token_ids) for o in out] == [4, 4]
        steps = [c for c in calls if c == "before_plan"]
        assert len(steps) >= 4 and calls[:3] == ["before_plan", ("fit_plan", 2), ("after_forward", 2)]
        assert (llm.engine.stats.async_steps == 0) == hold, (hold, llm.engine.stats.async_steps)


def test_queued_requests_count_as_waiting_and_unfinished(tiny_engine):
    llm = tiny_engine(model=None, prefix_caching=False)
    feature = _Recorder([], False)
    llm.engine.features.append(feature)
    assert not llm.engine.has_unfinished_requests()
    feature.queued = 3
    assert llm.engine.has_unfinished_requests()
    llm.engine.step()
    assert llm.engine.stats.num_waiting == 3
