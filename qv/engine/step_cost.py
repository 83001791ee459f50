"""What a step costs, learned from the engine's own steps, and the prompt tokens a step may hold under a
latency target (`max_step_ms`).

A step's time is modelled as a fixed part (reading the weights once, launches) plus rows times a
per-row cost by kind: decode rows (one token, or a verification's k+1), chat prompt rows and Clef
record rows (which also run the low-rank deltas), plus a fixed part of its own for a step with any prompt
rows (decode-only steps replay one CUDA graph; a step with prompt rows runs attention and the GDN
recurrence eagerly between pieces, or the whole forward eagerly). Without that jump a fit can only explain
the first prompt row's cost by a huge per-row cost, and plans the floor forever. A second jump, for a step of
more rows than the linears' few-row kernels take (`row_limit`: past it the GPTQ linear dequantizes each whole
weight ahead of cuBLAS), lets the planner keep small steps under that edge. `StepCostModel` fits the
six numbers by exponentially-weighted least squares over recent steps (in relative error), pulled towards
a prior where the steps seen say nothing (a direction no recent step varied). `StepTimer` feeds it: a
step's time is from its launch, or from the previous step's results if later (the device runs steps one
after another), to its results on the host.

`plan_prompt_tokens` is the pure planning rule the scheduler calls while sequences decode: every
waiting prompt gets the same number of tokens (shorter prompts take what they need and leave the
rest to the others), as many as keep the predicted step under the target, and never fewer than
`MIN_PROMPT_SHARE` each, so records and long prompts progress however slow the decodes are. Where the floor
shares would carry the step past `row_limit`, they shrink to stay under it (one token each at least).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np

from qv.engine.prefix_cache import is_isolated

MIN_PROMPT_SHARE = 16  # tokens every waiting prompt gets each step, even when decodes alone pass the target
HALF_LIFE_STEPS = 64  # an observation's weight in its fit halves after this many newer ones of its kind
PRIOR_STEPS = 2.0  # the prior counts as this many steps of a typical shape
TYPICAL_DECODE_ROWS = 8.0  # the scale of a decode-only step's rows in the prior
TYPICAL_PROMPT_ROWS = 256.0  # the scale of a step's prompt (or Clef) rows in the prior
TYPICAL_WIDE_ROWS = 2048.0  # of a step past the row limit's (whole chunks mostly: its jump weighs little beside them)
WARM_STEPS = 16  # before this many steps an observation is taken as it is
OUTLIER_FACTOR = 4.0  # afterwards, a step is counted as at most this times its prediction (a compile, a GC pause)
REFERENCE_MS = 10.0  # a step of this time weighs 1 in the fit; others by (REFERENCE_MS / ms)^2 (relative errors)
MIN_WEIGHED_MS = 0.5  # shorter steps weigh as one of this time: a clock tick must not outweigh every real step


@dataclass(frozen=True)
class StepCost:
    """Milliseconds of a step: fixed + rows of each kind times their per-row cost, + prompt_step_ms if it has
    prompt or Clef rows, + wide_step_ms if it also has more rows than row_limit (None: the linears have no such
    edge)."""

    fixed_ms: float
    decode_row_ms: float
    prompt_row_ms: float
    clef_row_ms: float
    prompt_step_ms: float = 0.0
    wide_step_ms: float = 0.0
    row_limit: int | None = None

    def is_wide(self, decode_rows: int, prompt_rows: int = 0, clef_rows: int = 0) -> bool:
        """Whether a step with prompt rows passes row_limit (decode-only steps are fitted apart, without it)."""
        return (self.row_limit is not None and prompt_rows + clef_rows > 0
                and decode_rows + prompt_rows + clef_rows > self.row_limit)

    def predict(self, decode_rows: int, prompt_rows: int = 0, clef_rows: int = 0) -> float:
        return (self.fixed_ms + decode_rows * self.decode_row_ms + prompt_rows * self.prompt_row_ms
                + clef_rows * self.clef_row_ms + (self.prompt_step_ms if prompt_rows + clef_rows else 0.0)
                + (self.wide_step_ms if self.is_wide(decode_rows, prompt_rows, clef_rows) else 0.0))


# the 27B GPTQ-Int8 model on one H100 (the whole-model bench; the wide jump: a 64-layer mixed step's linears take
# ~47 ms past 64 rows, ~14 under): a start until the engine's own steps say better
DEFAULT_PRIOR = StepCost(fixed_ms=12.0, decode_row_ms=0.3, prompt_row_ms=0.1, clef_row_ms=0.15, prompt_step_ms=10.0,
                         wide_step_ms=30.0)


class _WeightedFit:
    """x . theta ~ ms over recent observations: exponentially-weighted least squares in relative error, pulled
    towards `prior` in the directions the observations leave open, no coefficient below zero."""

    def __init__(self, prior: np.ndarray, typical: np.ndarray, decay: float):
        """typical: one typical observation's x per coefficient (rows; the diagonal is the coefficient's own
        feature); each coefficient's prior weighs as much as PRIOR_STEPS such observations."""
        self.prior, self.decay = prior, decay
        weights = (REFERENCE_MS / np.maximum(typical @ prior, 1e-3)) ** 2
        self.ridge = PRIOR_STEPS * np.diag(weights * np.square(np.diag(typical)))
        self.gram = np.zeros((len(prior), len(prior)))  # sum of decayed w x x^T
        self.moment = np.zeros(len(prior))  # sum of decayed w x ms
        self.theta = prior

    def observe(self, x: np.ndarray, ms: float, step_ms: float) -> None:
        """ms: what x accounts for; step_ms: the whole step's time, which sets the weight (relative errors: a
        long prefill step's noise must not swamp the fixed cost of a decode step)."""
        weight = (REFERENCE_MS / max(step_ms, MIN_WEIGHED_MS)) ** 2
        self.gram = self.decay * self.gram + weight * np.outer(x, x)
        self.moment = self.decay * self.moment + weight * ms * x
        self.theta = _solve_nonnegative(self.gram + self.ridge, self.moment + self.ridge @ self.prior)


class StepCostModel:
    """The step cost fitted to recent steps, in two parts that each forget only with steps of their own kind: the
    decode-only step (fixed + decode rows) from decode-only steps, and what prompt rows add (the jump, prompt
    and Clef rows) from the other steps, over the decode-only part's prediction for their decode rows. A long
    stretch of records beside chats (no decode-only step) thus keeps the decode-only step the ratio target
    multiplies, and a steady batch keeps its split between fixed and per-row costs from the prior."""

    def __init__(self, prior: StepCost = DEFAULT_PRIOR, half_life_steps: float = HALF_LIFE_STEPS,
                 row_limit: int | None = None):
        """row_limit: the most rows the linears take on their few-row kernels (StepCost.row_limit)."""
        self.prior = replace(prior, row_limit=row_limit)
        self.decay = 0.5 ** (1.0 / half_life_steps)
        self.reset()

    def reset(self) -> None:
        """Forget the steps seen (start-up's warm-up steps, which include compiles): the prior again."""
        p, rows = self.prior, TYPICAL_PROMPT_ROWS
        self.decode = _WeightedFit(np.array([p.fixed_ms, p.decode_row_ms]),
                                   np.array([[1.0, 0.0], [1.0, TYPICAL_DECODE_ROWS]]), self.decay)
        self.prompt = _WeightedFit(np.array([p.prompt_step_ms, p.prompt_row_ms, p.clef_row_ms, p.wide_step_ms]),
                                   np.array([[1.0, rows, 0.0, 0.0], [1.0, rows, 0.0, 0.0], [1.0, 0.0, rows, 0.0],
                                             [1.0, TYPICAL_WIDE_ROWS, 0.0, 1.0]]), self.decay)
        self.num_steps = 0
        self.cost = p

    def observe(self, decode_rows: int, prompt_rows: int, clef_rows: int, ms: float) -> None:
        if decode_rows + prompt_rows + clef_rows == 0 or not np.isfinite(ms) or ms < 0:
            return
        if self.num_steps >= WARM_STEPS:
            ms = min(ms, OUTLIER_FACTOR * self.cost.predict(decode_rows, prompt_rows, clef_rows))
        if prompt_rows + clef_rows:
            wide = float(self.prior.is_wide(decode_rows, prompt_rows, clef_rows))
            self.prompt.observe(np.array([1.0, prompt_rows, clef_rows, wide]), ms - self.cost.predict(decode_rows), ms)
        else:
            self.decode.observe(np.array([1.0, decode_rows]), ms, ms)
        self.num_steps += 1
        fixed, decode_row = self.decode.theta
        jump, prompt_row, clef_row, wide = self.prompt.theta
        self.cost = StepCost(float(fixed), float(decode_row), float(prompt_row), float(clef_row), float(jump),
                             float(wide), self.prior.row_limit)


def _solve_nonnegative(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The least-squares solution of the normal equations a x = b with no cost below zero (a negative cost is
    the fit's noise, not a step that gets faster with more rows): the most negative coefficient is held at zero
    and the rest solved again. Clamping after one solve breaks the fit wherever features move together (a
    steady batch of decodes), where one coefficient's excess is another's deficit."""
    free = np.ones(len(b), dtype=bool)
    while True:
        x = np.zeros(len(b))
        x[free] = np.linalg.solve(a[np.ix_(free, free)], b[free])
        if (x >= 0).all():
            return x
        free[np.argmin(x)] = False


def plan_prompt_tokens(cost: StepCost, target_ms: float, decode_rows: int, prompts: list[tuple[int, bool]],
                       budget: int, min_share: int = MIN_PROMPT_SHARE, row_buckets: tuple[int, ...] = ()) -> list[int]:
    """Tokens for each waiting prompt, given as (tokens left, is a Clef record), in a step that also holds
    `decode_rows` decode rows: the same count t for each (or all it has left, if fewer), t the largest that
    keeps the predicted step within `target_ms` and the total within `budget` tokens, and at least
    min(left, min_share) each while the budget allows. row_buckets: the row counts the step's forward is
    padded to (the piecewise CUDA graphs' sizes, ascending); the rows up to the step's bucket are then filled
    with more prompt tokens, which cost little more than the padding they replace.

    With cost.row_limit (the linears' few-row edge), a step stays within it, its floor shrinking to fit, unless a
    step past it fits the target (its wide_step_ms included) with more tokens."""
    if not prompts:
        return []
    limit = cost.row_limit
    if limit is not None and row_buckets and any(b <= limit for b in row_buckets):
        limit = max(b for b in row_buckets if b <= limit)  # the forward runs its bucket's rows
    if limit is None or decode_rows >= limit:
        return _shares(cost, target_ms, decode_rows, prompts, budget, min_share, row_buckets, wide=limit is not None)
    # prompts past the room under the edge go past it, a token each
    room = min(budget, max(limit - decode_rows, len(prompts)))
    within = _shares(cost, target_ms, decode_rows, prompts, room, min_share,
                     tuple(b for b in row_buckets if b <= limit), wide=False)
    past = _shares(cost, target_ms, decode_rows, prompts, budget, min_share, row_buckets, wide=True)
    if sum(past) > sum(within) and decode_rows + sum(past) > limit and \
            cost.predict(decode_rows, *_split(past, prompts)) <= target_ms:
        return past
    return within


def _split(tokens: list[int], prompts: list[tuple[int, bool]]) -> tuple[int, int]:
    """(chat prompt rows, Clef rows) of a plan."""
    clef = sum(n for n, (_, is_clef) in zip(tokens, prompts) if is_clef)
    return sum(tokens) - clef, clef


def _shares(cost: StepCost, target_ms: float, decode_rows: int, prompts: list[tuple[int, bool]], budget: int,
            min_share: int, row_buckets: tuple[int, ...], wide: bool) -> list[int]:
    """plan_prompt_tokens within `budget`, the step predicted with (wide) or without the wide jump."""
    floor_share = max(1, min(min_share, budget // len(prompts)))
    row_ms = [cost.clef_row_ms if clef else cost.prompt_row_ms for _, clef in prompts]
    spare_ms = target_ms - cost.predict(decode_rows) - cost.prompt_step_ms - (cost.wide_step_ms if wide else 0.0)

    def fits(t: int) -> bool:
        taken = [min(left, t) for left, _ in prompts]
        return sum(taken) <= budget and sum(n * ms for n, ms in zip(taken, row_ms)) <= spare_ms

    lo, hi = 0, max(left for left, _ in prompts)
    while lo < hi:  # the largest t that fits: fits() only turns false as t grows
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    share = max(lo, floor_share)
    tokens, left_in_budget = [], budget
    for left, _ in prompts:  # the floor may pass the budget only where prompts outnumber it
        n = min(left, share, left_in_budget)
        tokens.append(n)
        left_in_budget -= n
    rows = decode_rows + sum(tokens)
    bucket = next((b for b in row_buckets if b >= rows), None)
    if bucket is not None and rows > decode_rows:
        _fill(tokens, [left for left, _ in prompts], min(bucket - rows, left_in_budget))
    return tokens


def _fill(tokens: list[int], lefts: list[int], spare: int) -> None:
    """Hand `spare` more tokens to the prompts in equal shares, none past what it has left (in place)."""
    while spare > 0:
        open_ = [i for i, (n, left) in enumerate(zip(tokens, lefts)) if n < left]
        if not open_:
            return
        share = max(1, spare // len(open_))
        for i in open_:
            extra = min(share, lefts[i] - tokens[i], spare)
            tokens[i] += extra
            spare -= extra


class StepTimer:
    """Times each launched step until its results are on the host and feeds the rows and the time to `model`."""

    def __init__(self, model: StepCostModel):
        self.model = model
        self.launched_at: dict[int, tuple[float, tuple[int, int, int]]] = {}
        self.last_collected = 0.0

    def launched(self, plan) -> None:
        """Call before the runner launches `plan`, while its sequences' computed tokens are not yet advanced."""
        rows = [0, 0, 0]
        for seq, n in plan.scheduled:
            rows[2 if is_isolated(seq) else 0 if seq.num_tokens - seq.num_computed_tokens <= 1 else 1] += n
        self.launched_at[id(plan)] = (time.perf_counter(), tuple(rows))

    def collected(self, plan) -> None:
        """Call once the step's results are on the host."""
        entry = self.launched_at.pop(id(plan), None)
        now = time.perf_counter()
        if entry is not None:
            start, rows = entry
            self.model.observe(*rows, 1e3 * (now - max(start, self.last_collected)))
        self.last_collected = now
