"""SIGTERM drains, under `qv serve` and plain `uvicorn qv.server:app` alike (real subprocesses, a real
signal): requests in flight may go on until the grace is nearly over, then a stream ends with an error
event and `[DONE]`, a non-streaming client gets a JSON 503 (not uvicorn's plain-text 500), a new
request and /health get 503, a second signal changes nothing, and the process exits within
shutdown_grace_s. In process: while draining, new
requests get 503 with Retry-After and /health says 503, and /metrics still answers."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from conftest import start_server

GRACE_S = 3.0
EXIT_SLACK_S = 0.75  # reaping the process and scheduling on a loaded machine, beyond the grace
LONG = 8000  # tokens no tiny-model request finishes within the grace


def _launch(kind: str, model_dir) -> tuple[subprocess.Popen, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QV_")}
    env.update(QV_SHUTDOWN_GRACE_S=str(GRACE_S), QV_MAX_MODEL_LEN=str(LONG + 192), PYTHONUNBUFFERED="1")
    if kind == "qv serve":
        argv = [sys.executable, "-m", "qv.cli", "serve", str(model_dir), "--port", "0"]
        ready = r"qv: serving model '[^']+' at (http://[\d.]+:\d+)/v1"
    else:
        env["QV_MODEL"] = str(model_dir)
        argv = [sys.executable, "-m", "uvicorn", "qv.server:app", "--host", "127.0.0.1", "--port", "0"]
        ready = r"Uvicorn running on (http://127\.0\.0\.1:\d+)"
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, deadline = [], time.time() + 240
    while True:
        line = proc.stdout.readline()
        assert line or proc.poll() is None, f"{kind} exited:\n" + "".join(lines)
        assert time.time() < deadline, f"{kind} did not start:\n" + "".join(lines)
        lines.append(line)
        m = re.search(ready, line)
        if m:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, m.group(1)


def _running(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:num_requests_running{"))


@pytest.mark.parametrize("kind, signals", [("qv serve", (signal.SIGTERM,)), ("uvicorn", (signal.SIGTERM,)),
                                           ("qv serve", (signal.SIGTERM, signal.SIGINT))])
def test_sigterm_drains_and_exits_within_the_grace(kind, signals, tiny_model):
    """A second signal (SIGTERM then Ctrl+C) changes nothing: uvicorn alone would cut every stream."""
    proc, url = _launch(kind, tiny_model)
    try:
        events, answer = [], {}
        chat = {"messages": [{"role": "user", "content": "go"}], "max_tokens": LONG, "ignore_eos": True,
                "stream": True}

        def stream():
            with httpx.stream("POST", url + "/v1/chat/completions", json=chat, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append((time.monotonic(), line[6:]))

        def whole():
            r = httpx.post(url + "/v1/completions", json={"prompt": "go", "max_tokens": LONG, "ignore_eos": True},
                           timeout=60)
            answer.update(status=r.status_code, type=r.headers.get("content-type"), text=r.text)

        clients = [threading.Thread(target=stream), threading.Thread(target=whole)]
        for t in clients:
            t.start()
        deadline = time.time() + 60
        while len(events) < 3 or _running(url) < 2:
            assert time.time() < deadline, "the two requests never ran"
            time.sleep(0.05)
        t0 = time.monotonic()
        proc.send_signal(signals[0])
        time.sleep(0.05)
        # a new request: refused by the drain (503), the listener open while requests are in flight
        late = httpx.post(url + "/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=10)
        assert late.status_code == 503 and "shutting down" in late.json()["error"]["message"], late.text
        assert httpx.get(url + "/health", timeout=10).status_code == 503
        for sig in signals[1:]:
            time.sleep(0.3)
            proc.send_signal(sig)
        proc.wait(timeout=GRACE_S + 10)
        exited = time.monotonic() - t0
        for t in clients:
            t.join(timeout=10)
        print(f"{kind}: exited {exited:.2f} s after SIGTERM, cut at {events[-2][0] - t0:.2f} s")
        assert exited <= GRACE_S + EXIT_SLACK_S, f"exited {exited:.2f} s after SIGTERM (grace {GRACE_S} s)"

        assert events[-1][1] == "[DONE]", events[-3:]
        final = json.loads(events[-2][1])["error"]
        assert final["code"] == 503 and "shutting down" in final["message"], final
        after = [e for e in events if e[0] > t0 + 0.5]
        assert len(after) > 2, "the stream was cut at once instead of running on during the grace"
        assert events[-2][0] - t0 >= GRACE_S - 1.0 - 0.25, "cut before the grace was nearly over"

        assert answer["status"] == 503 and answer["type"] == "application/json", answer
        assert "shutting down" in json.loads(answer["text"])["error"]["message"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def test_drain_refuses_new_requests_and_cuts_streams(tiny_model):
    """The drain without a signal (the server runs in a thread here): begun by hand on its loop."""
    running, stop = start_server(tiny_model, shutdown_grace_s=2.0)
    try:
        state = running.app.state.qv
        lines = []
        body = {"prompt": "go", "max_tokens": 900, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", running.v1 + "/completions", json=body, timeout=60) as r:
            it = r.iter_lines()
            while len(lines) < 2:
                line = next(it)
                if line.startswith("data: "):
                    lines.append(line)
            drained = time.monotonic()
            state.loop.call_soon_threadsafe(state.begin_drain)
            time.sleep(0.2)
            r2 = httpx.post(running.v1 + "/completions", json={"prompt": "new", "max_tokens": 2}, timeout=10)
            assert r2.status_code == 503 and r2.headers["retry-after"] == "1", r2.text
            assert r2.json()["error"]["type"] == "ServiceUnavailableError" and "shutting down" in r2.text
            assert httpx.get(running.url + "/health", timeout=10).status_code == 503
            assert httpx.get(running.url + "/metrics", timeout=10).status_code == 200
            lines += [line for line in it if line.startswith("data: ")]
            cut_after = time.monotonic() - drained
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["error"]["code"] == 503
        assert 0.9 <= cut_after <= 2.0, cut_after  # cut at grace - 1 s = 1 s after the drain began
        deadline = time.time() + 10
        while running.metric("vllm:num_requests_running") > 0:  # the cut stream's request was aborted
            assert time.time() < deadline
            time.sleep(0.05)
    finally:
        stop()
