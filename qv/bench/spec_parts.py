"""`qv bench --spec mtp|ngram`: what each part of a speculative step costs at the model's shapes, and the
decode rate it gives at a stated acceptance length. Random weights accept nothing, so the parts are timed
on the same sequences by switching the speculator's policy (qv/spec/speculator.py):

  plain        policy "off": the decode graph alone, no MTP work: the step without speculation
  spec step    policy "always": verification of k drafts (k+1 rows a sequence) and the next drafts
  draft        MTP: the head's graph (catch-up and the k-step walk) replayed alone; n-gram: the host's
               lookups for the batch
  verify       spec step - draft (MTP); the spec step itself (n-gram, whose lookups run on the host)
  backed off   policy "backoff" once the failed drafts have paused every sequence: what a step costs a
               sequence whose drafts never pay (the head's catch-up, and a probe every 65 steps)
  projected    acceptance length x batch / spec step, in tokens/s
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

ACCEPTANCE_LENGTH = 3.6  # the seed's production mean (k = 3)
BACKOFF_STEPS = 140  # decode steps for the pauses to reach their longest (4 failures, then 4+8+16+32+64)
REPLAYS = 20
BACKED_OFF_STEPS = 65  # timed: one probe in a period of the longest pause
SPEC_PARTS_EXTRA_STEPS = 2 + 3 + BACKOFF_STEPS + BACKED_OFF_STEPS  # decode steps beyond the timed plain and spec ones


@dataclass
class SpecMeasured:
    batch: int
    context: int
    plain_s: float
    spec_s: float
    draft_s: float
    backed_off_s: float
    source: str  # "mtp" | "ngram"

    @property
    def verify_s(self) -> float:
        return self.spec_s - self.draft_s if self.source == "mtp" else self.spec_s

    def record(self) -> dict:
        return {"batch": self.batch, "context": self.context, "source": self.source, "plain_s": self.plain_s,
                "spec_step_s": self.spec_s, "verify_s": self.verify_s, "draft_s": self.draft_s,
                "backed_off_s": self.backed_off_s, "verify_vs_plain": self.verify_s / self.plain_s,
                "draft_vs_plain": self.draft_s / self.plain_s, "backed_off_vs_plain": self.backed_off_s / self.plain_s,
                "acceptance_length": ACCEPTANCE_LENGTH,
                "projected_tokens_per_s": ACCEPTANCE_LENGTH * self.batch / self.spec_s}


@contextlib.contextmanager
def speculator_policy(spec, policy: str):
    """The speculator under `policy` for the block, its own policy restored after."""
    before = spec.policy
    spec.policy = policy
    try:
        yield
    finally:
        spec.policy = before


def _timed_steps(run, counts: dict[str, int], steps: int) -> float:
    run.sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        run.engine_step(counts)
    run.sync()
    return (time.perf_counter() - t0) / steps


def _draft_graph_s(runner, batch: int) -> float:
    """The MTP head's draft graph after a verification step, replayed alone (its inputs are the last step's:
    it rewrites the same head KV)."""
    graphs = runner.verify_graphs
    size = graphs.bucket(batch) if graphs is not None else None
    if size is None or (size, "draft") not in graphs.mtp_graphs:
        raise RuntimeError(f"no MTP draft graph for batch {batch}: the spec rows need CUDA graphs on")
    graph, _ = graphs.mtp_graphs[(size, "draft")]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / REPLAYS


def _ngram_lookup_s(engine, counts: dict[str, int]) -> float:
    """The host's n-gram lookups of one step for these sequences."""
    spec = engine.spec
    seqs = [engine.requests[rid].seqs[0] for rid in counts]
    t0 = time.perf_counter()
    for _ in range(REPLAYS):
        for seq in seqs:
            spec.choose(seq, None)
    return (time.perf_counter() - t0) / REPLAYS


def spec_parts(run, counts: dict[str, int], batch: int, context: int, steps: int) -> SpecMeasured:
    """Every part on the sequences of `counts` (prefilled, decoding): plain, spec step and draft, then the
    steady state of backoff. Leaves the speculator's policy as it found it."""
    engine = run.engine
    spec = engine.spec
    with speculator_policy(spec, "off"):
        for _ in range(2):
            run.engine_step(counts)
        plain = _timed_steps(run, counts, steps)
    with speculator_policy(spec, "always"):
        for _ in range(3):  # drafts made under "always" reach the verification graphs
            run.engine_step(counts)
        spec_step = _timed_steps(run, counts, steps)
        source = "mtp" if spec.uses_mtp else "ngram"
        draft = _draft_graph_s(engine.runner, batch) if source == "mtp" else _ngram_lookup_s(engine, counts)
    with speculator_policy(spec, "backoff"):
        for _ in range(BACKOFF_STEPS):
            run.engine_step(counts)
        backed_off = _timed_steps(run, counts, BACKED_OFF_STEPS)
    return SpecMeasured(batch, context, plain, spec_step, draft, backed_off, source)


def spec_table(records: list[dict], prefill: list[dict]) -> str:
    """The markdown section for --spec rows."""
    if not records and not prefill:
        return ""
    ms = lambda s: f"{s * 1e3:.2f} ms"  # noqa: E731
    lines = [f"speculative decoding ({records[0]['source'] if records else 'on'}); projected at mean acceptance "
             f"length {ACCEPTANCE_LENGTH} (random weights accept nothing: each part is timed, qv/bench/spec_parts.py)",
             "", "| batch | context | plain step | verify step | draft | backed-off step | projected tokens/s |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in records:
        lines.append(f"| {r['batch']} | {r['context']:,} | {ms(r['plain_s'])} | {ms(r['verify_s'])} "
                     f"({r['verify_vs_plain']:.2f}x) | {ms(r['draft_s'])} ({r['draft_vs_plain']:.0%}) | "
                     f"{ms(r['backed_off_s'])} ({r['backed_off_vs_plain']:.2f}x) | "
                     f"{r['projected_tokens_per_s']:,.0f} |")
    if prefill:
        lines += ["", "| prefill | without speculation | with | ratio |", "| ---: | ---: | ---: | ---: |"]
        for p in prefill:
            lines.append(f"| {p['tokens']:,} | {p['plain_s']:.2f} s | {p['spec_s']:.2f} s | "
                         f"{p['spec_s'] / p['plain_s']:.3f} |")
    return "\n".join(lines)
