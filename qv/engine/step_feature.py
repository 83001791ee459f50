"""The one interface through which a part of the step plugs into LLMEngine and ModelRunner (the prefix
cache's state copies and snapshots, the vision steps, Clef records, speculation, structured outputs):
the engine and the runner call each hook of every feature they hold, in order, and ask nothing else of
them. A hook a feature does not need keeps the default here, which does nothing. A feature keeps its
per-sequence state itself (keyed by the Sequence, weakly where it outlives no request), not on Sequence.

The hooks in the order of a step:
  engine   before_plan -> fit_plan
  runner   replayable, samples, fill_inputs (the step's inputs) -> take_hidden (after the forward)
  engine   after_forward -> on_token (each appended token) -> after_result (each sequence's result)
           -> holds_next_step (before launching the next step early); finished_output, report"""

from __future__ import annotations


class StepFeature:
    # -- the engine's loop ---------------------------------------------------------------------
    def before_plan(self, scheduler) -> list[str]:
        """Before a step is planned: the request ids this changed (Clef records admitted, or failed)."""
        return []

    def fit_plan(self, plan) -> None:
        """Trim the planned step (in place) to what this feature can do in it (the vision budget)."""

    def after_forward(self, scheduled, scheduler) -> list[str]:
        """Once the step's rows have run, before its results free finished sequences: the request ids
        this finished (answered Clef records)."""
        return []

    def on_token(self, seq, token_id: int, scheduler) -> bool:
        """A token appended to seq: True where this feature finished the sequence with it (a grammar's end)."""
        return False

    def after_result(self, seq, result) -> None:
        """A sequence's step result, once its tokens are appended."""

    def holds_next_step(self, scheduler) -> bool:
        """Whether the next step must wait for this one's results (async scheduling stays off for it)."""
        return False

    def finished_output(self, request_id: str) -> dict:
        """A finished request's RequestOutput fields this feature fills (Clef's `clef`)."""
        return {}

    def report(self, stats) -> None:
        """Fill this feature's counters of the engine's EngineStats."""

    @property
    def num_queued(self) -> int:
        """Requests this feature holds outside the scheduler."""
        return 0

    # -- the runner's step ---------------------------------------------------------------------
    def replayable(self, seqs, deltas_captured: bool) -> bool:
        """Whether a CUDA graph captured for plain rows may run these sequences' forward (deltas_captured: it
        launches the grouped low-rank deltas over the step's delta fields)."""
        return True

    def samples(self, seq) -> bool:
        """Whether seq samples a token when its rows catch up with its tokens (Clef records never do)."""
        return True

    def fill_inputs(self, seqs, cu, host) -> dict[str, int]:
        """Write this feature's rows of the step's input fields (host: name -> NumPy, qv/engine/step_inputs.py;
        cu: each sequence's row offsets) and return how many elements of each it wrote."""
        return {}

    def take_hidden(self, seqs, cu, hidden, host_ids) -> None:
        """After the forward: the step's final-norm hidden rows and the token ids that ran."""
