"""The one interface through which a part of the step loop plugs into LLMEngine (the prefix cache's
state copies and snapshots, the vision steps, Clef records): the engine calls each hook of every
feature it holds, in order, and asks nothing else of them. A hook a feature does not need keeps
the default here, which does nothing."""

from __future__ import annotations


class StepFeature:
    def before_plan(self, scheduler) -> list[str]:
        """Before a step is planned: the request ids this changed (Clef records admitted, or failed)."""
        return []

    def fit_plan(self, plan) -> None:
        """Trim the planned step (in place) to what this feature can do in it (the vision budget)."""

    def after_forward(self, scheduled, scheduler) -> list[str]:
        """Once the step's rows have run, before its results free finished sequences: the request ids
        this finished (answered Clef records)."""
        return []

    def holds_next_step(self, scheduler) -> bool:
        """Whether the next step must wait for this one's results (async scheduling stays off)."""
        return False

    @property
    def num_queued(self) -> int:
        """Requests this feature holds outside the scheduler."""
        return 0
