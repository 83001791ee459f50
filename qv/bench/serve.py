"""`qv bench serve`: chats and Clef records together against a `qv serve`, over HTTP (in the spirit of
`vllm bench serve`).

It starts a `qv serve` subprocess on a free loopback port (a model folder, a preset with random
weights, or the embedded tiny model) or targets a running one by URL, then drives it for
`duration_s` with a seeded mix: chat clients (a share of them streamed, a share of the streamed ones
hanging up mid-stream) and record clients (POST /v1/systemone with states of `record_lengths`
words). Closed loop by default (each client sends its next request when the last one ends); with a
request rate, arrivals are Poisson and `concurrency` caps the requests in flight. The report is one
markdown table and a JSON record: TTFT, ITL and end-to-end percentiles, output, prompt and record
throughput, errors, and the deltas of the server's own /metrics over the run. For soaks it also reports the
server's RSS (and its anonymous and file-backed parts), device memory (torch's and the driver's count) and
the Triton kernels compiled inside steps where they settled (the first of 16 scrapes over the load at or after
`settle_s`) against the end, the RSS of every scrape (flat or climbing), and whether
fixed greedy probe chats, sent to the idle server before the load and after the drain, answer the same.

    report = asyncio.run(drive(url, ServeSpec(...)))   # against a running server
    print(serve_markdown(report))
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from qv.errors import StartupError

WORDS = ("order", "checkout", "error", "service", "payment", "customer", "delivery", "refund", "account", "login",
         "page", "slow", "blocked", "support", "ticket", "today", "urgent", "status", "server", "update")
QUESTIONS = {"outage": {"type": "noul", "instructions": "Is a service down?"},
             "urgency": {"type": "score", "criteria": ["Can wait", "This week", "Today"]}}
# counters and histograms of qv/server/metrics.py whose change over the run the report carries
SERVER_METRICS = ("vllm:num_preemptions_total", "vllm:request_queue_time_seconds_sum",
                  "vllm:request_queue_time_seconds_count", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                  "vllm:admission_rejections_total", "vllm:request_success_total")
# the server's memory as /metrics tells it: prometheus-client's process collector (RSS) and qv's gauges (RSS by
# kind, device memory as torch's allocator and as the driver count it)
MEMORY_METRICS = {"rss": "process_resident_memory_bytes", "rss_anon": "qv:process_resident_anon_bytes",
                  "rss_file": "qv:process_resident_file_bytes", "device": "qv:device_memory_reserved_bytes",
                  "device_used": "qv:device_memory_used_bytes"}
KERNELS_METRIC = "qv:kernel_compiles_total"  # Triton kernels compiled inside steps after the warm-up
SAMPLE_COLUMNS = ("s", *MEMORY_METRICS, "compiles")  # a memory sample: seconds into the load, MiB, compiles
MEMORY_SAMPLES = 16  # memory scrapes over the load (the JSON's memory.samples; the table shows them)
PERCENTILES = (50, 95, 99)
DRAIN_S = 120.0  # the longest a request still in flight at the end of the run is waited for


@dataclass
class ServeSpec:
    chats: int = 4  # chat clients (closed loop) or the chat share of arrivals (request rate)
    records: int = 2  # record clients, or the record share of arrivals
    stream_fraction: float = 0.5  # chats that stream
    hangup_fraction: float = 0.0  # streamed chats whose client closes the connection mid-stream
    prompt_len: int = 64  # words of a chat prompt (the tiny tokenizer: about one token each)
    output_len: int = 32  # max_tokens of a chat (ignore_eos, so each runs to it)
    record_lengths: tuple[int, ...] = (256,)  # words of a record's state, drawn uniformly per record
    request_rate: float = 0.0  # requests/s, Poisson; 0: closed loop
    concurrency: int = 0  # most requests in flight with a request rate; 0: chats + records
    duration_s: float = 30.0
    seed: int = 0
    model_name: str = ""  # the served name chats ask for; "": the server's first /v1/models entry
    settle_s: float = 0.0  # seconds into the load at which memory counts as settled; 0: a quarter of the duration
    probes: int = 2  # greedy probe chats before the load and after the drain

    def __post_init__(self):
        bad = [f"{k} must be >= 0" for k in ("chats", "records", "prompt_len", "request_rate", "concurrency",
                                             "settle_s", "probes") if getattr(self, k) < 0]
        if self.settle_s >= self.duration_s > 0:
            bad.append("settle_s must be shorter than the duration")
        bad += [f"{k} must be in [0, 1]" for k in ("stream_fraction", "hangup_fraction")
                if not 0 <= getattr(self, k) <= 1]
        if self.chats + self.records == 0:
            bad.append("give at least one chat or record client")
        if self.output_len < 1 or self.duration_s <= 0 or not self.record_lengths or min(self.record_lengths) < 1:
            bad.append("output_len, duration_s and every record length must be positive")
        if bad:
            raise ValueError("qv bench serve: " + "; ".join(bad))


@dataclass
class _Tally:
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    chat_e2e: list[float] = field(default_factory=list)
    record_e2e: list[float] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("chats", "streamed", "hung_up", "records", "errors", "prompt_tokens", "output_tokens"), 0))
    error_samples: list[str] = field(default_factory=list)

    def error(self, what: str) -> None:
        self.counts["errors"] += 1
        if len(self.error_samples) < 5:
            self.error_samples.append(what[:300])


class _Driver:
    def __init__(self, client, spec: ServeSpec, model: str):
        self.client, self.spec, self.model = client, spec, model
        self.rng = random.Random(spec.seed)
        self.tally = _Tally()

    def _words(self, n: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(n))

    async def one(self, kind: str) -> None:
        """One request of `kind` ("chat" or "record"); every failure is counted, never raised."""
        try:
            if kind == "record":
                await self._record()
            else:
                stream = self.rng.random() < self.spec.stream_fraction
                hang_at = (self.rng.randint(1, max(1, self.spec.output_len // 2))
                           if stream and self.rng.random() < self.spec.hangup_fraction else None)
                await (self._streamed_chat(hang_at) if stream else self._chat())
        except Exception as e:  # a refused connection, a timeout, a body that is not JSON: an error of the run
            self.tally.error(f"{kind}: {type(e).__name__}: {e}")

    def _chat_body(self, stream: bool) -> dict:
        body = {"model": self.model, "messages": [{"role": "user", "content": self._words(self.spec.prompt_len)}],
                "max_tokens": self.spec.output_len, "ignore_eos": True, "temperature": 0.0, "stream": stream}
        if stream:  # token ids in every chunk: tokens that decode to no text (random weights) still count
            body["stream_options"], body["return_token_ids"] = {"include_usage": True}, True
        return body

    async def _chat(self) -> None:
        t0 = time.perf_counter()
        r = await self.client.post("/v1/chat/completions", json=self._chat_body(False))
        if r.status_code != 200:
            return self.tally.error(f"chat: HTTP {r.status_code}: {r.text}")
        usage = r.json()["usage"]
        self.tally.chat_e2e.append(time.perf_counter() - t0)
        self._count("chats", usage["prompt_tokens"], usage["completion_tokens"])

    async def _streamed_chat(self, hang_at: int | None) -> None:
        t0 = time.perf_counter()
        last, tokens, usage, ttft, gaps = None, 0, None, None, []
        async with self.client.stream("POST", "/v1/chat/completions", json=self._chat_body(True)) as r:
            if r.status_code != 200:
                return self.tally.error(f"streamed chat: HTTP {r.status_code}: {(await r.aread()).decode()}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return self.tally.error(f"streamed chat: {event['error']}")
                usage = event.get("usage") or usage
                new = sum(len(c.get("token_ids") or ()) for c in event.get("choices", ()))
                if not new:
                    continue
                now = time.perf_counter()
                if ttft is None:
                    ttft = now - t0
                else:
                    gaps.append(now - last)
                last, tokens = now, tokens + new
                if hang_at is not None and tokens >= hang_at:  # leaving the block closes the connection
                    self.tally.counts["hung_up"] += 1
                    break
        if ttft is not None:  # a hung-up stream's latencies up to the hang-up are real
            self.tally.ttft.append(ttft)
            self.tally.itl.extend(gaps)
        if hang_at is not None and tokens >= hang_at:
            self.tally.counts["output_tokens"] += tokens
            return
        if usage is None:
            return self.tally.error("streamed chat: the stream ended without a usage chunk")
        self.tally.chat_e2e.append(time.perf_counter() - t0)
        self.tally.counts["streamed"] += 1
        self._count("chats", usage["prompt_tokens"], usage["completion_tokens"])

    async def _record(self) -> None:
        t0 = time.perf_counter()
        body = {"model": "clef", "state": self._words(self.rng.choice(self.spec.record_lengths)),
                "questions": QUESTIONS}
        r = await self.client.post("/v1/systemone", json=body)
        if r.status_code != 200:
            return self.tally.error(f"record: HTTP {r.status_code}: {r.text}")
        answer = r.json()
        if set(answer.get("answers", {})) != set(QUESTIONS):
            return self.tally.error(f"record: answers {sorted(answer.get('answers', {}))} for {sorted(QUESTIONS)}")
        self.tally.record_e2e.append(time.perf_counter() - t0)
        self._count("records", answer["usage"]["input_tokens"], 0)

    def _count(self, kind: str, prompt: int, output: int) -> None:
        c = self.tally.counts
        c[kind] += 1
        c["prompt_tokens"] += prompt
        c["output_tokens"] += output

    async def closed_loop(self, kind: str, end: float) -> None:
        while time.perf_counter() < end:
            await self.one(kind)

    async def open_loop(self, end: float) -> None:
        spec = self.spec
        gate = asyncio.Semaphore(spec.concurrency or spec.chats + spec.records)
        tasks: set[asyncio.Task] = set()

        async def gated(kind: str) -> None:
            async with gate:
                await self.one(kind)

        while True:
            await asyncio.sleep(self.rng.expovariate(spec.request_rate))
            if time.perf_counter() >= end:
                break
            kind = "record" if self.rng.random() < spec.records / (spec.chats + spec.records) else "chat"
            task = asyncio.create_task(gated(kind))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(tasks)


async def drive(url: str, spec: ServeSpec, api_key: str | None = None) -> dict:
    """Run the mix against the server at `url` (…/v1 or its root) and return the report record."""
    import httpx

    root = url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=root, headers=headers, timeout=httpx.Timeout(DRAIN_S + spec.duration_s),
                                 limits=limits) as client:
        model = spec.model_name or (await client.get("/v1/models")).json()["data"][0]["id"]
        if spec.records:  # a server without a Clef head would turn every record into an error: say so at once
            probe = await client.post("/v1/systemone", json={"model": "clef", "state": "probe", "questions": QUESTIONS})
            if probe.status_code in (400, 404):
                raise StartupError(f"the server answers no records (HTTP {probe.status_code}: {probe.text}); run with "
                                   f"--records 0, or serve a model with a Clef head")
        probes_before = await _probe_answers(client, model, spec, "before")
        before = await _scrape(client, SERVER_METRICS)
        driver = _Driver(client, spec, model)
        t0 = time.perf_counter()
        end = t0 + spec.duration_s
        if spec.request_rate > 0:
            work = [driver.open_loop(end)]
        else:
            work = [driver.closed_loop("chat", end) for _ in range(spec.chats)]
            work += [driver.closed_loop("record", end) for _ in range(spec.records)]
        samples: list[tuple[float, dict]] = []
        sampler = asyncio.create_task(_sample_memory(client, t0, spec.duration_s / MEMORY_SAMPLES, samples))
        await asyncio.wait_for(asyncio.gather(*work), spec.duration_s + DRAIN_S)
        elapsed = time.perf_counter() - t0
        sampler.cancel()
        after = await _scrape(client, SERVER_METRICS + tuple(MEMORY_METRICS.values()) + (KERNELS_METRIC,))
        settle_s = spec.settle_s or spec.duration_s / 4
        settled = next((m for t, m in samples if t >= settle_s), after)
        memory = _memory_change(settled, after)
        memory["sample_columns"] = list(SAMPLE_COLUMNS)
        memory["samples"] = [[round(t, 1)] + [None if m[n] is None else round(m[n] / 2**20, 1)
                                              for n in MEMORY_METRICS.values()] + [m[KERNELS_METRIC]]
                             for t, m in samples]
        probes_after = await _probe_answers(client, model, spec, "after")
    report = _report(url, spec, model, driver.tally, elapsed, before, after)
    mismatched = [i for i, (a, b) in enumerate(zip(probes_before, probes_after)) if a != b]
    report.update(memory=memory, probes={"n": len(probes_before), "identical": not mismatched,
                                         "mismatched": mismatched})
    return report


async def _probe_answers(client, model: str, spec: ServeSpec, phase: str) -> list[str]:
    """The texts of spec.probes fixed greedy chats, one at a time on the otherwise idle server. Each phase
    salts the prefix cache, so the second phase recomputes its prompts exactly as the first did."""
    rng = random.Random(f"probe-{spec.seed}")
    answers = []
    for i in range(spec.probes):
        words = " ".join(rng.choice(WORDS) for _ in range(8 + 4 * i))
        r = await client.post("/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": words}], "max_tokens": 16, "temperature": 0.0,
            "cache_salt": f"qv-bench-probe-{phase}"})
        if r.status_code != 200:
            raise StartupError(f"a greedy probe chat failed ({phase} the load): HTTP {r.status_code}: {r.text}")
        answers.append(r.json()["choices"][0]["message"]["content"] or "")
    return answers


async def _scrape(client, names) -> dict[str, float | None]:
    """The server's /metrics samples of `names`, each summed over its labels (None where the server has none)."""
    from prometheus_client.parser import text_string_to_metric_families

    r = await client.get("/metrics")
    r.raise_for_status()
    out: dict[str, float | None] = dict.fromkeys(names)
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            if sample.name in out:
                out[sample.name] = (out[sample.name] or 0.0) + sample.value
    return out


async def _sample_memory(client, t0: float, every_s: float, into: list) -> None:
    """(seconds into the load, the memory scrape) every every_s seconds until cancelled: where the server's
    memory settled, and whether it then stays flat or keeps climbing."""
    while True:
        into.append((time.perf_counter() - t0, await _scrape(client, (*MEMORY_METRICS.values(), KERNELS_METRIC))))
        await asyncio.sleep(every_s)


def _memory_change(settled: dict, end: dict) -> dict:
    """MiB where memory settled and at the end, and the relative change (None where the server does not say),
    and the kernels compiled inside steps by then and by the end; settled and end: scrapes holding MEMORY_METRICS' names
    (and KERNELS_METRIC's, where scraped)."""
    out = {}
    for key, name in MEMORY_METRICS.items():
        a, b = settled.get(name), end.get(name)
        out[f"{key}_settled_mib"] = None if a is None else a / 2**20
        out[f"{key}_end_mib"] = None if b is None else b / 2**20
        out[f"{key}_change"] = (b - a) / a if a and b is not None else None
    out["compiles_settled"], out["compiles_end"] = settled.get(KERNELS_METRIC), end.get(KERNELS_METRIC)
    return out


def _percentiles(values: list[float]) -> dict:
    """p50/p95/p99 and the mean in ms (nearest rank); None where nothing was measured."""
    if not values:
        return {"n": 0, "mean": None, **{f"p{p}": None for p in PERCENTILES}}
    s = sorted(values)
    ranked = {f"p{p}": 1e3 * s[min(len(s) - 1, max(0, -(-p * len(s) // 100) - 1))] for p in PERCENTILES}
    return {"n": len(s), "mean": 1e3 * sum(s) / len(s), **ranked}


def _report(url: str, spec: ServeSpec, model: str, tally: _Tally, elapsed: float, before: dict, after: dict) -> dict:
    delta = {k: (after[k] or 0.0) - (before[k] or 0.0) for k in SERVER_METRICS}  # a counter never seen: 0
    queued = delta["vllm:request_queue_time_seconds_count"]
    c = tally.counts
    return {
        "url": url, "model": model, "spec": {**asdict(spec), "record_lengths": list(spec.record_lengths)},
        "elapsed_s": elapsed, "requests": dict(c), "errors": c["errors"], "error_samples": tally.error_samples,
        "ttft_ms": _percentiles(tally.ttft), "itl_ms": _percentiles(tally.itl),
        "chat_e2e_ms": _percentiles(tally.chat_e2e), "record_e2e_ms": _percentiles(tally.record_e2e),
        "output_tok_s": c["output_tokens"] / elapsed, "prompt_tok_s": c["prompt_tokens"] / elapsed,
        "records_s": c["records"] / elapsed,
        "server": {"preemptions": delta["vllm:num_preemptions_total"],
                   "queue_time_mean_ms": 1e3 * delta["vllm:request_queue_time_seconds_sum"] / queued if queued else None,
                   "requests_finished": delta["vllm:request_success_total"],
                   "prompt_tokens": delta["vllm:prompt_tokens_total"],
                   "generation_tokens": delta["vllm:generation_tokens_total"],
                   "admission_rejections": delta["vllm:admission_rejections_total"]},
    }


def serve_markdown(report: dict) -> str:
    """One table: latencies with their percentiles, then throughputs, errors and the server's deltas."""
    def ms(v):
        return "" if v is None else f"{v:.1f}"

    s, c, srv = report["spec"], report["requests"], report["server"]
    head = (f"qv bench serve: {report['url']} ({report['model']}), {report['elapsed_s']:.1f} s, "
            f"{s['chats']} chats + {s['records']} records"
            + (f" at {s['request_rate']} req/s" if s["request_rate"] else " (closed loop)") + f", seed {s['seed']}")
    lines = [head, "", "| metric | n | mean | p50 | p95 | p99 |", "|---|---:|---:|---:|---:|---:|"]
    for key, name in (("ttft_ms", "chat TTFT (ms, streamed)"), ("itl_ms", "chat ITL (ms, streamed)"),
                      ("chat_e2e_ms", "chat end-to-end (ms)"), ("record_e2e_ms", "record end-to-end (ms)")):
        p = report[key]
        lines.append(f"| {name} | {p['n']} | {ms(p['mean'])} | {ms(p['p50'])} | {ms(p['p95'])} | {ms(p['p99'])} |")
    scalars = (("output tok/s", f"{report['output_tok_s']:.1f}"), ("prompt tok/s", f"{report['prompt_tok_s']:.1f}"),
               ("records/s", f"{report['records_s']:.2f}"),
               ("requests (chats, streamed, hung up, records)",
                f"{c['chats']}, {c['streamed']}, {c['hung_up']}, {c['records']}"),
               ("errors", str(report["errors"])), ("server: preemptions", f"{srv['preemptions']:.0f}"),
               ("server: mean queue time (ms)", ms(srv["queue_time_mean_ms"])),
               ("server: requests finished", f"{srv['requests_finished']:.0f}"),
               ("server: admission rejections", f"{srv['admission_rejections']:.0f}"))
    mem, probes = report["memory"], report["probes"]
    for key, name in (("rss", "server RSS"), ("rss_anon", "server RSS, anonymous"),
                      ("rss_file", "server RSS, file-backed"), ("device", "server device memory (torch)"),
                      ("device_used", "device memory in use (driver)")):
        if mem.get(f"{key}_settled_mib") is not None and mem.get(f"{key}_end_mib") is not None:
            change = "" if mem[f"{key}_change"] is None else f" ({100 * mem[f'{key}_change']:+.1f}%)"
            scalars += ((f"{name}: settled -> end (MiB)",
                         f"{mem[f'{key}_settled_mib']:.0f} -> {mem[f'{key}_end_mib']:.0f}{change}"),)
    if mem.get("compiles_settled") is not None and mem.get("compiles_end") is not None:
        scalars += (("server: kernels compiled inside steps, settled -> end",
                     f"{mem['compiles_settled']:.0f} -> {mem['compiles_end']:.0f}"),)
    if mem.get("samples"):
        rss = SAMPLE_COLUMNS.index("rss")
        scalars += (("server RSS over the load (MiB, every ~1/16 of it)",
                     " ".join("?" if row[rss] is None else f"{row[rss]:.0f}" for row in mem["samples"])),)
    scalars += (("greedy probes identical before and after",
                 f"{'yes' if probes['identical'] else 'no: ' + str(probes['mismatched'])} ({probes['n']})"),)
    lines += [f"| {name} | | {value} | | | |" for name, value in scalars]
    lines += [f"\nerror: {e}" for e in report["error_samples"]]
    return "\n".join(lines)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def started_server(model: str | None, preset: str | None, serve_args: list[str], startup_timeout_s: float):
    """A `qv serve` subprocess on a free loopback port, ready (GET /health answers 200); yields its URL and
    stops it on exit. A server that exits or does not answer in time raises StartupError with its log."""
    import httpx

    if model is not None and preset is not None:
        raise ValueError("qv bench serve: give a model folder or --preset, not both")
    with tempfile.TemporaryDirectory(prefix="qv-bench-serve-") as tmp:
        args = list(serve_args)
        if preset is not None:  # its shapes with random weights, and a random Clef folder where the preset has one
            from qv.bench.clef_folder import HEADS, add_clef
            from qv.bench.presets import write_preset

            folder = write_preset(preset, Path(tmp) / preset)
            if preset in HEADS:
                add_clef(folder, preset)
            model, args = str(folder), ["--load-format", "random", *args]
        port = free_port()
        log_path = Path(tmp) / "server.log"
        cmd = [sys.executable, "-m", "qv.cli", "serve", *([model] if model else []), "--host", "127.0.0.1",
               "--port", str(port), *args]
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + startup_timeout_s
            while True:
                if proc.poll() is not None:
                    raise StartupError(f"qv serve exited with status {proc.returncode}: {_tail(log_path)}")
                if time.monotonic() > deadline:
                    raise StartupError(f"qv serve did not answer /health within {startup_timeout_s:.0f} s: "
                                       f"{_tail(log_path)}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                        break
                time.sleep(0.5)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _tail(path: Path, lines: int = 15) -> str:
    return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
