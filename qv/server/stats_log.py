"""The periodic stats line of `qv serve` (vLLM's "Engine 000: Avg prompt throughput ..." line): every
log_stats_interval_s while the engine has work, from the counters /metrics exports (engine.stats()), so
the two never disagree.

Fields are vLLM's: prompt and generation tokens/s over the interval, running and waiting sequences, KV
cache usage, the prefix-cache hit rate of the tokens looked up in the interval, and with speculation the
mean acceptance length and draft acceptance rate of the interval. vLLM's old "Swapped" has no counterpart:
qv preempts by recompute (a preempted sequence waits again), so the line counts preemptions instead."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("qv.stats")


@dataclass
class _Totals:
    at: float
    prompt_tokens: int
    generation_tokens: int
    preemptions: int
    prefix_queries: int
    prefix_hits: int
    drafts: int
    draft_tokens: int
    accepted_tokens: int


def _totals(s, at: float) -> _Totals:
    return _Totals(at, s.prompt_tokens, s.generation_tokens, s.num_preemptions, s.prefix_cache_queries,
                   s.prefix_cache_hits, s.spec_num_drafts or 0, s.spec_num_draft_tokens or 0,
                   s.spec_num_accepted_tokens or 0)


class StatsLine:
    """Turns successive reads of the engine's counters into vLLM-style lines; `line()` is None while idle
    (nothing running or waiting and no token since the last line), so an idle server logs nothing."""

    def __init__(self, stats: Callable, clock: Callable[[], float] = time.monotonic):
        self.stats, self.clock = stats, clock
        self.last = _totals(stats(), clock())

    def line(self) -> str | None:
        s = self.stats()
        now = _totals(s, self.clock())
        last, self.last = self.last, now
        dt = max(now.at - last.at, 1e-9)
        prompt, gen = now.prompt_tokens - last.prompt_tokens, now.generation_tokens - last.generation_tokens
        if not (s.num_running or s.num_waiting or prompt or gen):
            return None
        queries, hits = now.prefix_queries - last.prefix_queries, now.prefix_hits - last.prefix_hits
        text = (f"Avg prompt throughput: {prompt / dt:.1f} tokens/s, Avg generation throughput: {gen / dt:.1f} "
                f"tokens/s, Running: {s.num_running} reqs, Waiting: {s.num_waiting} reqs, Preempted: "
                f"{now.preemptions - last.preemptions}, KV cache usage: {100 * s.kv_cache_usage:.1f}%, "
                f"Prefix cache hit rate: {100 * hits / queries if queries else 0.0:.1f}%")
        if s.spec_num_drafts is not None:
            drafts, drafted = now.drafts - last.drafts, now.draft_tokens - last.draft_tokens
            accepted = now.accepted_tokens - last.accepted_tokens
            if drafts:
                text += (f", Spec mean acceptance length: {1 + accepted / drafts:.2f}, Draft acceptance rate: "
                         f"{100 * accepted / max(drafted, 1):.1f}%")
        return text


async def log_stats(stats: Callable, interval_s: float) -> None:
    """Logs a stats line every interval_s while there is work; runs until cancelled."""
    lines = StatsLine(stats)
    while True:
        await asyncio.sleep(interval_s)
        text = lines.line()
        if text is not None:
            log.info("%s", text)
