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


class _EveryHook(StepFeature):
    """Counts the calls of the runner's hooks and the engine's per-token and per-result ones."""

    def __init__(self):
        self.calls: dict[str, int] = {}

    def _count(self, name):
        self.calls[name] = self.calls.get(name, 0) + 1

    def samples(self, seq):
        self._count("samples")
        return True

    def fill_inputs(self, seqs, cu, host):
        self._count("fill_inputs")
        assert len(cu) == len(seqs) + 1 and "delta_rows" in host
        return {}

    def take_hidden(self, seqs, cu, hidden, host_ids):
        self._count("take_hidden")
        assert hidden.shape[0] == len(host_ids) == cu[-1]

    def on_token(self, seq, token_id, scheduler):
        self._count("on_token")
        return False

    def after_result(self, seq, result):
        self._count("after_result")

    def finished_output(self, request_id):
        self._count("finished_output")
        return {}

    def report(self, stats):
        self._count("report")


def test_the_runner_and_the_engine_call_every_feature_hook(tiny_engine):
    """The runner holds the engine's feature list: a feature added to it is asked at each step whether its
    sequences sample, fills its input rows and sees the hidden rows; the engine hands it each token, each
    result and each finished request."""
    llm = tiny_engine(model=None, prefix_caching=False)
    feature = _EveryHook()
    llm.engine.features.append(feature)
    assert llm.engine.runner.features is llm.engine.features
    out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 10]}],
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    c = feature.calls
    assert [len(o.outputs[0].token_ids) for o in out] == [4, 4]
    assert c["on_token"] == c["after_result"] == 8 and c["finished_output"] == 2, c
    assert c["fill_inputs"] == c["take_hidden"] >= 4 and c["samples"] >= 8 and c["report"] >= 4, c
