"""The per-sequence draft backoff (qv/spec/speculator.py: Backoff) against the schedule its comment states:
FAILURES_TO_PAUSE failed drafts in a row, then pauses doubling from MIN_PAUSE to MAX_PAUSE decode steps with one
probe after each, and one accepted token restarting the whole schedule."""

from __future__ import annotations

from qv.spec.speculator import FAILURES_TO_PAUSE, MAX_PAUSE, MIN_PAUSE, Backoff


def drafting_steps(backoff: Backoff, steps: int, accepts=lambda step: 0) -> list[int]:
    """The decode steps (0-based) at which the sequence drafts; accepts(step): tokens its draft there accepts."""
    drafted = []
    for step in range(steps):
        if backoff.paused():
            continue
        drafted.append(step)
        backoff.drafted(accepts(step))
    return drafted


def expected_never_paying(steps: int) -> list[int]:
    """The stated schedule of a sequence whose drafts never pay, computed independently of Backoff."""
    out, step, pause = list(range(FAILURES_TO_PAUSE)), FAILURES_TO_PAUSE - 1, MIN_PAUSE
    while True:
        step += pause + 1
        if step >= steps:
            return out
        out.append(step)
        pause = min(2 * pause, MAX_PAUSE)


def test_drafts_that_never_pay_back_off_to_one_probe_in_max_pause_plus_one():
    steps = 1000
    got = drafting_steps(Backoff(), steps)
    assert got == expected_never_paying(steps)
    gaps = [b - a for a, b in zip(got, got[1:])]
    assert gaps[-1] == MAX_PAUSE + 1 and gaps.count(MAX_PAUSE + 1) >= 5
    doublings = (MAX_PAUSE // MIN_PAUSE).bit_length() - 1  # probes with shorter pauses before the steady state
    assert gaps.index(MAX_PAUSE + 1) == FAILURES_TO_PAUSE - 1 + doublings


def test_one_accepted_probe_restarts_the_schedule():
    accepted = []

    def accepts(step: int) -> int:  # the first probe past step 300 (backed off to the longest pause) pays
        if step > 300 and not accepted:
            accepted.append(step)
            return 1
        return 0

    steps = 1000
    got = drafting_steps(Backoff(), steps, accepts)
    (at,) = accepted
    assert got[:got.index(at) + 1] == [s for s in expected_never_paying(steps) if s <= at]
    after = [s - at - 1 for s in got if s > at]  # from the step after the accepted one, as from a fresh sequence
    assert after == expected_never_paying(steps - at - 1)


def test_an_accepted_draft_resets_the_failure_count():
    b = Backoff()
    for _ in range(FAILURES_TO_PAUSE - 1):
        b.drafted(0)
    b.drafted(2)
    for _ in range(FAILURES_TO_PAUSE - 1):
        b.drafted(0)
    assert not b.paused()  # three failures after the accepted draft: not yet paused
    b.drafted(0)
    assert b.pause == MIN_PAUSE and b.paused() and b.pause == MIN_PAUSE - 1
