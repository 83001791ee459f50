"""What `qv serve` says: the start-up hint, a vLLM-style stats line while it works, one log format for qv and
uvicorn, no access lines for the /health and /metrics probes, and no Clef cap warning from two defaults."""

from __future__ import annotations

import logging
import os
import queue
import re
import subprocess
import sys
import threading

import httpx

from qv.engine.engine import EngineStats
from qv.server.log_setup import SkipProbes
from qv.server.stats_log import StatsLine
from util import stop


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_stats_line_fields_over_the_interval():
    s, clock = EngineStats(prompt_tokens=500, generation_tokens=10, prefix_cache_queries=100), Clock()
    lines = StatsLine(lambda: s, clock)
    clock.now += 2
    assert lines.line() is None  # idle: nothing running or waiting, no token since the last line
    s.prompt_tokens += 400
    s.generation_tokens += 60
    s.num_running, s.num_waiting, s.kv_cache_usage = 3, 1, 0.25
    s.prefix_cache_queries += 400
    s.prefix_cache_hits += 100
    s.num_preemptions = 2
    clock.now += 4
    assert lines.line() == ("Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 15.0 tokens/s, "
                            "Running: 3 reqs, Waiting: 1 reqs, Preempted: 2, KV cache usage: 25.0%, "
                            "Prefix cache hit rate: 25.0%")
    s.num_running = s.num_waiting = 0
    clock.now += 4
    assert lines.line() is None  # the counters did not move: silent again


def test_stats_line_speculation_fields():
    s, clock = EngineStats(spec_num_drafts=0, spec_num_draft_tokens=0, spec_num_accepted_tokens=0), Clock()
    lines = StatsLine(lambda: s, clock)
    s.generation_tokens, s.num_running = 40, 1
    s.spec_num_drafts, s.spec_num_draft_tokens, s.spec_num_accepted_tokens = 10, 30, 15
    clock.now += 1
    assert lines.line().endswith(", Spec mean acceptance length: 2.50, Draft acceptance rate: 50.0%")


def test_probe_access_lines_are_filtered():
    def record(path: str) -> logging.LogRecord:
        return logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d',
                                 ("127.0.0.1:5", "GET", path, "1.1", 200), None)

    keep = SkipProbes().filter
    assert not keep(record("/health")) and not keep(record("/metrics")) and not keep(record("/health?x=1"))
    assert keep(record("/v1/chat/completions")) and keep(record("/v1/models"))


def test_qv_serve_says_what_it_is_doing(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("QV_")}
    env.update(PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "qv.cli", "serve", "--port", "0", "--max-model-len", "512",
                             "--state-dir", str(tmp_path), "--log-stats-interval-s", "0.2"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    arrived: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [arrived.put(line) for line in proc.stdout], daemon=True).start()

    def read_until(pattern: str) -> re.Match:
        while True:
            try:
                line = arrived.get(timeout=240)
            except queue.Empty:
                raise AssertionError(f"no line matching {pattern!r}:\n" + "".join(lines)) from None
            lines.append(line)
            m = re.search(pattern, line)
            if m:
                return m

    try:
        url = read_until(r"qv: serving model '[^']+' at (http://[\d.]+:\d+)/v1").group(1)
        read_until(r"qv: the model has random weights")
        hint = "".join(lines)
        assert f"qv: API docs: {url}/docs" in hint and f"qv: try: curl -s {url}/v1/chat/completions" in hint
        for _ in range(3):
            assert httpx.get(url + "/health").status_code == 200
        assert httpx.get(url + "/metrics").status_code == 200
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 16, "temperature": 0},
                       timeout=120)
        assert r.status_code == 200, r.text
        # the first stats lines may cover intervals before the completion's tokens counted: read on to one that saw them
        rates = [float(read_until(r"Avg generation throughput: ([\d.]+) tokens/s").group(1))]
        while rates[-1] == 0 and len(rates) < 50:
            rates.append(float(read_until(r"Avg generation throughput: ([\d.]+) tokens/s").group(1)))
        assert rates[-1] > 0, rates
        if not any('"POST /v1/completions HTTP/1.1" 200' in line for line in lines):  # either may come first
            read_until(r'"POST /v1/completions HTTP/1.1" 200')
    finally:
        stop(proc)
    log = "".join(lines)
    assert "GET /health" not in log and "GET /metrics" not in log
    stamped = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: ")
    printed = ("qv: ", "building the embedded tiny default model")  # the hint and first-start progress: printed
    logged = [line for line in lines if not line.startswith(printed)]
    unformatted = [line for line in logged if line.strip() and not stamped.match(line)]
    assert not unformatted, "lines not in qv's log format:\n" + "".join(unformatted)
    assert any(" INFO uvicorn.access: " in line for line in logged)
    assert "WARNING" not in log, log  # the default Clef cap (max_model_len < QV_CLEF_NMAX) is not a warning
