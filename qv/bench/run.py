"""The rows of `qv bench`, measured by driving `LLMEngine` directly (add_request with prompt token
ids, then step()), as `vllm bench latency` drives its engine:

  decode at each batch size: B random prompts of `batch_context` tokens prefilled to their first
      token, a few warm-up steps, then `steps` timed decode steps (ms per step);
  decode at batch 1 for each long context and prefill for each prefill length: one request per
      length; a length that is both is one request, its prefill timed (add_request to the step that
      sampled the first token), then its decode steps timed from that context.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from qv.bench.profile import profile_steps
from qv.bench.spec_parts import SPEC_PARTS_EXTRA_STEPS, spec_parts, speculator_policy
from qv.engine.request import SamplingParams

PROFILE_STEPS = 3


@dataclass(frozen=True)
class BenchSpec:
    batch_sizes: tuple[int, ...] = (1, 8, 16, 32, 64)
    batch_context: int = 1024  # prompt tokens of each sequence in the batch rows
    contexts: tuple[int, ...] = (32768, 131072)  # decode at batch 1 from these contexts
    prefill_lengths: tuple[int, ...] = (32768, 131072, 250000)
    steps: int = 32  # timed decode steps per row
    warmup: int = 4  # decode steps before timing (first replays, allocator warm-up)
    profile: bool = False  # per-kernel tables of one decode step at the smallest and largest batch
    linears: bool = False  # the GPTQ linears beside cuBLAS and the floor (qv/bench/peers.py)
    attention: bool = False  # a prompt chunk over an int8 prefix beside SDPA and the floor (qv/bench/peers.py)
    seed: int = 0  # of the random prompts

    def __post_init__(self):
        for name in ("batch_sizes", "contexts", "prefill_lengths"):
            if any(n < 1 for n in getattr(self, name)):
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.batch_context < 1 or self.steps < 1 or self.warmup < 0:
            raise ValueError("batch_context and steps must be >= 1 and warmup >= 0")

    @property
    def longest(self) -> int:
        """max_model_len the rows need: the longest prompt plus every decode step after it."""
        prompts = list(self.contexts) + list(self.prefill_lengths) + ([self.batch_context] if self.batch_sizes else [])
        # with speculation on, spec_parts runs each row's sequences on: plain, spec and backed-off steps
        spec_parts_steps = 2 * self.steps + SPEC_PARTS_EXTRA_STEPS
        return max(prompts, default=1) + self.warmup + self.steps + PROFILE_STEPS + 2 + spec_parts_steps

    @property
    def max_batch(self) -> int:
        return max(self.batch_sizes, default=1)

    @property
    def long_lengths(self) -> list[int]:
        return sorted(set(self.contexts) | set(self.prefill_lengths))

    @property
    def num_rows(self) -> int:
        return len(set(self.batch_sizes)) + len(set(self.contexts)) + len(set(self.prefill_lengths))


@dataclass
class Measured:
    """One row as timed. context_read: the mean tokens each sequence attended to per timed step."""

    kind: str  # "decode" | "prefill"
    batch: int
    tokens: int  # context length (decode) or prompt length (prefill)
    measured_s: float  # per step (decode) or the whole prefill
    steps: int | None = None
    context_read: float | None = None


class BenchRun:
    def __init__(self, engine, spec: BenchSpec):
        self.engine, self.spec = engine, spec
        self.device = engine.runner.device
        self.rng = random.Random(spec.seed)
        self.ids = 0
        self.profiles: list[dict] = []
        self.spec_records: list[dict] = []  # with speculation on: qv/bench/spec_parts.py per decode row
        self.spec_prefill: list[dict] = []  # prefill without and with speculation
        cfg = engine.model_config
        # media placeholders in a prompt would need media: draw ids below every such id
        media = [t for t in (cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id,
                             cfg.vision_end_token_id) if t is not None]
        self.id_limit = min([cfg.vocab_size] + media)
        # never finishes on its own: each row aborts its requests once timed
        self.params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _prompt(self, length: int) -> list[int]:
        return [self.rng.randrange(self.id_limit) for _ in range(length)]

    def _add(self, prompt: list[int]) -> str:
        rid = f"bench-{self.ids}"
        self.ids += 1
        self.engine.add_request(rid, prompt, self.params)
        return rid

    def engine_step(self, counts: dict[str, int]) -> None:
        """One engine step; counts[request id] := its output tokens so far."""
        for out in self.engine.step():
            if out.request_id in counts:
                if out.error or out.outputs[0].finish_reason == "error":
                    raise RuntimeError(f"the engine failed benchmark request {out.request_id}: {out.error}")
                counts[out.request_id] = len(out.outputs[0].token_ids)

    def _prefill(self, counts: dict[str, int], profile_last: bool = False) -> None:
        """Step until every request has its first token; profile_last: the step of the last chunk runs under
        the profiler (the longest prefill's, where attention over the longest cached prefix costs most)."""
        last = None
        while any(n == 0 for n in counts.values()):
            seq = self.engine.requests[next(iter(counts))].seqs[0]
            if profile_last and 0 < seq.num_tokens - seq.num_computed_tokens <= self.engine.cfg.max_num_batched_tokens:
                # chunks may end early at snapshot boundaries: the last one profiled is the prompt's last (with
                # async scheduling the call that launches it returns before its token: the next one is not profiled)
                last = dict(profile_steps(lambda: self.engine_step(counts), 1, self.device), batch=1,
                            context=len(seq.prompt_token_ids), kind="prefill")
                continue
            self.engine_step(counts)
        if last is not None:
            self.profiles.append(last)

    def _decode(self, counts: dict[str, int], prompt_len: int) -> tuple[float, float]:
        """Warm-up, then the timed steps: (seconds per step, mean context read per sequence)."""
        for _ in range(self.spec.warmup):
            self.engine_step(counts)
        steps, before = self.spec.steps, list(counts.values())
        self.sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            self.engine_step(counts)
        self.sync()
        per_step = (time.perf_counter() - t0) / steps
        if any(n - b < steps for n, b in zip(counts.values(), before)):  # accepted drafts add more
            raise RuntimeError("a timed decode step did not advance every sequence by at least one token")
        # step i attends to prompt + outputs-before-it tokens (the newest one is its input row)
        return per_step, prompt_len + sum(before) / len(before) + (steps - 1) / 2

    def _finish(self, counts: dict[str, int]) -> None:
        for rid in counts:
            self.engine.abort_request(rid)

    def batch_row(self, batch: int, profile: bool) -> Measured:
        length = self.spec.batch_context
        counts = {self._add(self._prompt(length)): 0 for _ in range(batch)}
        self._prefill(counts)
        per_step, context = self._decode(counts, length)
        self._spec_parts(counts, batch, length)
        if profile:
            p = profile_steps(lambda: self.engine_step(counts), PROFILE_STEPS, self.device)
            self.profiles.append(dict(p, batch=batch, context=length, kind="decode"))
        self._finish(counts)
        return Measured("decode", batch, length, per_step, self.spec.steps, context)

    def long_rows(self, length: int) -> list[Measured]:
        rows, prompt = [], self._prompt(length)  # made before the clock starts: 250K draws take a while
        self.sync()
        t0 = time.perf_counter()
        counts = {self._add(prompt): 0}
        self._prefill(counts, self.spec.profile and length == max(self.spec.prefill_lengths, default=0))
        self.sync()
        if length in self.spec.prefill_lengths:
            rows.append(Measured("prefill", 1, length, time.perf_counter() - t0))
        if length in self.spec.contexts:
            per_step, context = self._decode(counts, length)
            rows.append(Measured("decode", 1, length, per_step, self.spec.steps, context))
            self._spec_parts(counts, 1, length)
        self._finish(counts)
        if length in self.spec.prefill_lengths and self.engine.spec is not None:
            self.spec_prefill.append({"tokens": length, "spec_s": rows[0].measured_s,
                                      "plain_s": self._prefill_without_spec(length)})
        return rows

    def _spec_parts(self, counts: dict[str, int], batch: int, context: int) -> None:
        spec = self.engine.spec
        if spec is not None and batch <= spec.max_seqs:
            self.spec_records.append(spec_parts(self, counts, batch, context, self.spec.steps).record())

    def _warm_prefills(self) -> None:
        """With speculation the prefill rows are compared with and without it: first a two-chunk prompt under
        each policy, so that neither timing holds the first chunk's kernel compiles and autotuning, then the
        longest prompt once, since kernels over longer cached prefixes compile on first use too."""
        longest = max(self.spec.prefill_lengths)
        two_chunks = min(2 * self.engine.cfg.max_num_batched_tokens + 1, longest)
        on = self.engine.spec.policy
        warm = [("off", two_chunks), (on, two_chunks), (on, longest)]
        for policy, length in warm:
            with speculator_policy(self.engine.spec, policy):
                counts = {self._add(self._prompt(length)): 0}
                self._prefill(counts)
                self._finish(counts)

    def _prefill_without_spec(self, length: int) -> float:
        """The same length's prefill (another prompt) with the speculator off: no MTP catch-up."""
        prompt = self._prompt(length)
        with speculator_policy(self.engine.spec, "off"):
            self.sync()
            t0 = time.perf_counter()
            counts = {self._add(prompt): 0}
            self._prefill(counts)
            self.sync()
            took = time.perf_counter() - t0
        self._finish(counts)
        return took

    def run(self) -> list[Measured]:
        """Every row, under one progress bar; decode rows first (by context, then batch), then prefills."""
        spec, rows = self.spec, []
        sizes = sorted(set(spec.batch_sizes))
        profiled = {sizes[0], sizes[-1]} if spec.profile and sizes else set()
        if self.engine.spec is not None and spec.prefill_lengths:
            self._warm_prefills()
        with tqdm(total=spec.num_rows, desc="qv bench", unit="row") as bar:
            for b in sizes:
                bar.set_postfix_str(f"decode batch {b} at {spec.batch_context} tokens")
                rows.append(self.batch_row(b, b in profiled))
                bar.update(1)
            for length in spec.long_lengths:
                bar.set_postfix_str(f"{length} tokens")
                done = self.long_rows(length)
                rows += done
                bar.update(len(done))
        return sorted(rows, key=lambda r: (r.kind != "decode", r.tokens, r.batch))
