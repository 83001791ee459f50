"""Prometheus metrics with vLLM's names (research/serving.md B.9), so vLLM dashboards, `vllm bench`
and GuideLLM read qv unchanged.

Gauges and engine-wide counters (tokens, preemptions, prefix cache, finished requests) are read
from `engine.stats()` at scrape time by a collector, so they never drift from the engine. Per-request
latency histograms are observed by the server as each request's outputs arrive. Each app has its
own registry, so several servers can live in one process (tests). qv's own gauges, under `qv:`, say
whether decode steps replay CUDA graphs (`qv:cuda_graphs_enabled`) and for which batch sizes, and what a
soak watches: device memory (torch's and the driver's count), resident memory split into anonymous and
file-backed, and the Triton kernels compiled inside steps after the warm-up.

Every `vllm:` name vLLM's Grafana dashboard queries is here with vLLM's type and labels, the legacy
ones as aliases vLLM keeps (`vllm:gpu_cache_usage_perc` of `vllm:kv_cache_usage_perc`,
`vllm:time_per_output_token_seconds` of `vllm:inter_token_latency_seconds`; tests/server/data holds
the dashboard's queries). HTTP request metrics (prometheus-fastapi-instrumentator's names, as vLLM
serves them) and the process, platform and GC collectors of prometheus-client join them.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from prometheus_client import (CollectorRegistry, Counter, GCCollector, Histogram,
                               PlatformCollector, ProcessCollector, generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily

LABELS = ("model_name", "engine")
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)  # vLLM's
HTTP_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)


def buckets_1_2_5(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to limit (vLLM's token-count buckets)."""
    out, exp = [], 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exp
            if v > limit:
                return out
            out.append(v)
        exp += 1


def step_token_histogram(name: str, doc: str, labels: list[str], step_tokens: dict[int, int]):
    """A histogram family of the steps' token counts (tokens -> steps) over ITERATION_TOKEN_BUCKETS."""
    counts = dict(step_tokens)  # one atomic copy: the engine thread adds to it
    cumulative = [(str(float(le)), sum(c for n, c in counts.items() if n <= le)) for le in ITERATION_TOKEN_BUCKETS]
    h = HistogramMetricFamily(name, doc, labels=LABELS)
    h.add_metric(labels, cumulative + [("+Inf", sum(counts.values()))], sum(n * c for n, c in counts.items()))
    return h


def _cuda_devices():
    """(torch.cuda, its device indices) where this process has started CUDA, else None."""
    torch = sys.modules.get("torch")  # never imported here: a server that has not loaded a model must not load it
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda, range(torch.cuda.device_count())


def _device_memory_reserved() -> float:
    cuda = _cuda_devices()
    return 0.0 if cuda is None else float(sum(map(cuda[0].memory_reserved, cuda[1])))


def _device_memory_used() -> float:
    """Bytes in use on this process's GPUs as the driver counts them (every process's, and what torch's allocator
    does not see: CUDA contexts, lazily loaded kernel modules, library workspaces)."""
    cuda = _cuda_devices()
    return 0.0 if cuda is None else float(sum(total - free for free, total in map(cuda[0].mem_get_info, cuda[1])))


def resident_memory_split(status: str | None = None) -> dict[str, float]:
    """The process's resident memory by kind from /proc/self/status (Linux), in bytes: anonymous (heaps, arenas,
    pinned buffers) and file-backed (pages of mapped libraries, such as the kernels a CUDA library loads on first
    use); {} where the system does not say."""
    if status is None:
        try:
            status = Path("/proc/self/status").read_text()
        except OSError:
            return {}
    out = {}
    for line in status.splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile") and value.split() and value.split()[-1] == "kB":
            out[key.removeprefix("Rss").lower()] = 1024.0 * float(value.split()[0])
    return out


class _EngineCollector:
    def __init__(self, engine, labels: tuple[str, str], cache_config: dict[str, str]):
        self.engine, self.labels, self.cache_config = engine, labels, cache_config

    def collect(self):
        s = self.engine.stats()
        lv = list(self.labels)

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=LABELS)
            g.add_metric(lv, value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=LABELS)
            c.add_metric(lv, value)
            return c

        yield gauge("vllm:num_requests_running", "Sequences in the running batch.", s.num_running)
        yield gauge("qv:device_memory_reserved_bytes", "Device memory torch's caching allocator holds in this "
                    "process, over its GPUs (0 without one; tensor-parallel workers not included).",
                    _device_memory_reserved())
        yield gauge("qv:device_memory_used_bytes", "Device memory in use as the driver counts it, over this "
                    "process's GPUs (every process's use of them; 0 without one).", _device_memory_used())
        for kind, value in resident_memory_split().items():
            yield gauge(f"qv:process_resident_{kind}_bytes", f"Resident memory of this process that is {kind} "
                        "(/proc/self/status; process_resident_memory_bytes is their sum with shared memory).", value)
        yield gauge("vllm:num_requests_waiting", "Sequences waiting to be scheduled.", s.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache block usage (1 = full).", s.kv_cache_usage)
        yield gauge("vllm:gpu_cache_usage_perc", "KV-cache block usage (1 = full); vLLM's legacy name of "
                    "vllm:kv_cache_usage_perc.", s.kv_cache_usage)
        yield gauge("vllm:cpu_cache_usage_perc", "Host-tier KV block usage (1 = full; 0 without kv_offload_bytes).",
                    s.host_cache_usage)
        yield gauge("vllm:num_requests_swapped", "Sequences swapped to the host: always 0 (qv preempts by "
                    "recomputing).", 0)
        yield step_token_histogram("vllm:iteration_tokens_total", "Tokens scheduled per engine step.", lv,
                                   s.step_tokens)
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the KV cache configuration.",
                                 labels=[*self.cache_config, "num_gpu_blocks", "engine"])
        info.add_metric([*self.cache_config.values(), str(s.num_gpu_blocks), self.labels[1]], 1)
        yield info
        yield counter("vllm:num_preemptions", "Preemptions (recompute).", s.num_preemptions)
        yield counter("qv:kernel_compiles", "Triton kernel variants compiled inside steps after the start-up's warm-up "
                      "(each stalls every request; the log names it).", getattr(s, "kernel_compiles", 0))
        yield counter("qv:num_deferred_readmissions", "Preempted requests past max_preemptions held back until their "
                      "full length fits beside the running ones.", getattr(s, "num_deferred_readmissions", 0))
        yield counter("vllm:prompt_tokens", "Prefill tokens processed.", s.prompt_tokens)
        yield counter("vllm:generation_tokens", "Generated tokens.", s.generation_tokens)
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits)
        yield counter("vllm:prompt_tokens_cached", "Prompt tokens served from the prefix cache.", s.prompt_tokens_cached)
        success = CounterMetricFamily("vllm:request_success", "Finished sequences by finish reason.",
                                      labels=LABELS + ("finished_reason",))
        for reason, count in sorted((getattr(s, "finished", None) or {}).items()):
            success.add_metric(lv + [str(reason)], count)
        yield success
        sizes = tuple(getattr(s, "cuda_graph_sizes", ()))  # qv's own: whether decode replays graphs
        yield gauge("qv:cuda_graphs_enabled", "1 if decode steps replay CUDA graphs, 0 if they run eagerly.",
                    1 if sizes else 0)
        graphs = InfoMetricFamily("qv:cuda_graphs", "Batch sizes with a captured decode CUDA graph.", labels=LABELS)
        graphs.add_metric(lv, {"batch_sizes": ",".join(map(str, sizes))})
        yield graphs
        # Speculative decoding, exported once EngineStats carries these counters (vLLM's names).
        for field, doc in (("spec_num_drafts", "Draft rounds."), ("spec_num_draft_tokens", "Draft tokens proposed."),
                           ("spec_num_accepted_tokens", "Draft tokens accepted.")):
            if getattr(s, field, None) is not None:
                yield counter("vllm:spec_decode_" + field.removeprefix("spec_"), doc, getattr(s, field))
        per_pos = getattr(s, "spec_num_accepted_tokens_per_pos", None)
        if per_pos is not None:
            c = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens by position.",
                                    labels=LABELS + ("position",))
            for pos, count in enumerate(per_pos):
                c.add_metric(lv + [str(pos)], count)
            yield c


class ServerMetrics:
    def __init__(self, engine, model_name: str, max_model_len: int, cache_config: dict[str, str] | None = None):
        """cache_config: the labels of vllm:cache_config_info (block_size, cache_dtype, ...)."""
        self.registry = CollectorRegistry(auto_describe=True)
        self.labels = (model_name, "0")
        self.registry.register(_EngineCollector(engine, self.labels, dict(cache_config or {})))
        r, lab = self.registry, LABELS
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        self.http = HTTPMetrics(r)

        def hist(name, doc, buckets):
            return Histogram(name, doc, lab, buckets=buckets, registry=r).labels(*self.labels)

        tokens = buckets_1_2_5(max_model_len)
        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between output tokens.", ITL_BUCKETS)
        self.itl_legacy = hist("vllm:time_per_output_token_seconds", "Time between output tokens; vLLM's legacy "
                               "name of vllm:inter_token_latency_seconds.", ITL_BUCKETS)
        self.tpot = hist("vllm:request_time_per_output_token_seconds", "Decode time per output token.", ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Arrival to last output.", LATENCY_BUCKETS)
        self.queue = hist("vllm:request_queue_time_seconds", "Time waiting before first scheduled.", LATENCY_BUCKETS)
        self.prefill = hist("vllm:request_prefill_time_seconds", "First scheduled to first token.", LATENCY_BUCKETS)
        self.decode = hist("vllm:request_decode_time_seconds", "First token to last token.", LATENCY_BUCKETS)
        self.inference = hist("vllm:request_inference_time_seconds", "First scheduled to finished.", LATENCY_BUCKETS)
        self.prompt_tokens = hist("vllm:request_prompt_tokens", "Prompt tokens per request.", tokens)
        self.generation_tokens = hist("vllm:request_generation_tokens", "Generated tokens per request.", tokens)
        self.max_generation_tokens = hist("vllm:request_max_num_generation_tokens", "Most tokens one of a "
                                          "request's n sequences generated.", tokens)
        self.params_n = hist("vllm:request_params_n", "The n parameter of requests.", (1, 2, 5, 10, 20))
        self.params_max_tokens = hist("vllm:request_params_max_tokens", "The max_tokens of requests.", tokens)
        self.rejections = Counter("vllm:admission_rejections", "Requests refused with 503 (waiting queue full).", lab,
                                  registry=r).labels(*self.labels)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def tracker(self, n: int, max_tokens: int | None) -> "RequestTracker":
        return RequestTracker(self, n, max_tokens)


class HTTPMetrics:
    """http_requests_total{handler, method, status} and http_request_duration_seconds{handler,
    method}: handler is the route's path template ("none" for no route), status its class ("2xx"),
    as prometheus-fastapi-instrumentator writes them (http_edges.MeasureHTTP observes them)."""

    def __init__(self, registry):
        self.requests = Counter("http_requests_total", "HTTP requests by handler, method and status class.",
                                ("handler", "method", "status"), registry=registry)
        self.latency = Histogram("http_request_duration_seconds", "HTTP request latency (to the response's end).",
                                 ("handler", "method"), buckets=HTTP_LATENCY_BUCKETS, registry=registry)

    def observe(self, handler: str, method: str, status: int, seconds: float) -> None:
        self.requests.labels(handler, method, f"{status // 100}xx").inc()
        self.latency.labels(handler, method).observe(seconds)


class RequestTracker:
    """Observes one request's latencies from the outputs the server receives."""

    def __init__(self, m: ServerMetrics, n: int, max_tokens: int | None):
        self.m = m
        self.start = time.perf_counter()
        self.first: float | None = None
        self.last: float | None = None
        self.tokens = 0
        m.params_n.observe(n)
        if max_tokens is not None:
            m.params_max_tokens.observe(max_tokens)

    def on_output(self, out) -> None:
        tokens = sum(len(o.token_ids) for o in out.outputs)
        new = tokens - self.tokens
        if new <= 0:
            return
        now = time.perf_counter()
        if self.first is None:
            self.first = now
            self.m.ttft.observe(now - self.start)
            new -= 1  # the first token's latency is TTFT, the rest are inter-token gaps
        if new > 0 and self.last is not None:
            gap = (now - self.last) / new
            for _ in range(new):
                self.m.itl.observe(gap)
                self.m.itl_legacy.observe(gap)
        self.last, self.tokens = now, tokens

    def on_finish(self, out) -> None:
        now = time.perf_counter()
        m = self.m
        m.e2e.observe(now - self.start)
        m.prompt_tokens.observe(len(out.prompt_token_ids))
        m.generation_tokens.observe(self.tokens)
        m.max_generation_tokens.observe(max((len(o.token_ids) for o in out.outputs), default=0))
        if self.first is not None and self.tokens > 1:
            m.tpot.observe((now - self.first) / (self.tokens - 1))
        em = out.metrics
        if em is not None and em.first_scheduled_time is not None:
            m.queue.observe(max(0.0, em.first_scheduled_time - em.arrival_time))
            if em.first_token_time is not None:
                m.prefill.observe(max(0.0, em.first_token_time - em.first_scheduled_time))
                if em.finished_time is not None:
                    m.decode.observe(max(0.0, em.finished_time - em.first_token_time))
            if em.finished_time is not None:
                m.inference.observe(max(0.0, em.finished_time - em.first_scheduled_time))
