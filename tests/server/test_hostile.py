"""A hostile client with a valid key (issue 40): each attack is refused or answered within its budget,
never with a 5xx, while a probe's small chats and /health stay served, and memory comes back.

The server is the real one in a thread of this process, built by `uvicorn_config` (the connection
levers of `qv serve`). QV_HOSTILE_MODEL names another model
folder (the 27B shapes on a GPU: a `qv bench` preset folder, its weights made at load); unset, the tiny
model. Everything talks to loopback only; every random choice is seeded."""

from __future__ import annotations

import gc
import json
import os
import random
import socket
import statistics
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from conftest import Running, start_server

SLACK_S = 5.0  # beyond an attack's own budget, for a loaded 2-core machine
HEALTH_S = 0.5  # the issue's bound on /health while an attack runs
LEVERS = dict(grammar_compile_timeout_s=3.0, grammar_compile_workers=1, grammar_mask_budget_ms=20.0,
              header_read_timeout_s=1.0, keep_alive_timeout_s=1.0, stream_stall_timeout_s=2.0, max_connections=64)


def _start(model_dir, **levers) -> tuple[Running, callable]:
    return start_server(model_dir, 2048, qv_connections=True, **levers)


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    """The embedded tiny model (vision and a Clef head), or QV_HOSTILE_MODEL's folder."""
    from qv.model.tiny import make_embedded

    folder = os.environ.get("QV_HOSTILE_MODEL") or make_embedded(tmp_path_factory.mktemp("hostile") / "embedded")
    random_weights = not any(Path(folder).glob("*.safetensors"))  # a `qv bench` preset folder: config.json alone
    running, stop = _start(folder, **LEVERS, **({"load_format": "random"} if random_weights else {}))
    with httpx.Client(base_url=running.url, timeout=120) as c:  # warm: the first chat and the first compile
        c.post("/v1/chat/completions", json=_chat("hi", 2))
        c.post("/v1/chat/completions", json=_chat("hi", 2, response_format={"type": "json_object"}))
    yield running
    stop()


def _chat(text: str, max_tokens: int, **extra) -> dict:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0, **extra}


def _schema(n_props: int, tag: str = "p") -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": {
        "type": "object", "properties": {f"{tag}{i}": {"type": "string"} for i in range(n_props)}}}}


def _state(running: Running):
    return running.app.state.qv


class Probe:
    """Small chats and /health in a loop on its own thread: their latencies, and any 5xx."""

    def __init__(self, url: str):
        self.url, self.chats, self.health, self.errors = url, [], [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        with httpx.Client(base_url=self.url, timeout=60) as c:
            while not self._stop.is_set():
                t0 = time.monotonic()
                r = c.get("/health")
                self.health.append(time.monotonic() - t0)
                t0 = time.monotonic()
                r2 = c.post("/v1/chat/completions", json=_chat("probe", 4))
                self.chats.append(time.monotonic() - t0)
                self.errors += [x.status_code for x in (r, r2) if x.status_code >= 500]
                time.sleep(0.05)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        t0 = time.monotonic()  # an attack refused at once still gets a sample of probes beside it
        while len(self.chats) < MIN_PROBES and self._thread.is_alive() and time.monotonic() - t0 < 120:
            time.sleep(0.05)
        self._stop.set()
        self._thread.join(timeout=120)


MIN_PROBES = 8  # chats a probe makes before it stops, however quick the attack beside it


def _p95(xs: list[float]) -> float:
    """The 95th percentile, never beyond the largest sample (few samples: no extrapolation)."""
    return statistics.quantiles(xs, n=20, method="inclusive")[-1] if len(xs) >= 2 else (xs[0] if xs else 0.0)


# ---- grammar compilation -------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt, lever", [
    (_schema(600), "grammar_max_properties"),
    ({"type": "json_schema", "json_schema": {"name": "s", "schema": {"enum": [str(i) for i in range(5000)]}}},
     "grammar_max_enum_entries"),
    ({"type": "json_schema", "json_schema": {"name": "s", "schema": {"anyOf": [{"type": "object", "properties": {
        f"a{i}": {"type": "integer"}}} for i in range(200)]}}}, "grammar_max_any_of"),
    ({"type": "json_schema", "json_schema": {"name": "s", "schema": json.loads(
        '{"type":"array","items":' * 40 + '{"type":"string"}' + '}' * 40)}}, "grammar_max_depth"),
    ({"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "string", "pattern": "a" * 5000}}},
     "grammar_max_regex_chars"),
    ({"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object", "description": "x" * 300_000}}},
     "grammar_max_spec_bytes"),
])
def test_grammar_limits_are_checked_before_compiling(hostile, fmt, lever):
    t0 = time.monotonic()
    r = httpx.post(hostile.v1 + "/chat/completions", json=_chat("x", 4, response_format=fmt), timeout=60)
    assert r.status_code == 400 and lever in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "response_format"
    assert time.monotonic() - t0 < SLACK_S


def test_guided_choice_and_regex_limits(hostile):
    for n, lever in ((5000, "grammar_max_enum_entries"), (100_000, "grammar_max_spec_bytes")):
        r = httpx.post(hostile.v1 + "/chat/completions", json=_chat("x", 4, guided_choice=[str(i) for i in range(n)]),
                       timeout=60)
        assert r.status_code == 400 and lever in r.text and r.json()["error"]["param"] == "guided_choice", r.text
    r = httpx.post(hostile.v1 + "/chat/completions", json=_chat("x", 4, guided_regex="a" * 5000), timeout=60)
    assert r.status_code == 400 and "grammar_max_regex_chars" in r.text, r.text


def test_errors_name_the_problem_without_library_paths(hostile):
    r = httpx.post(hostile.v1 + "/chat/completions", json=_chat("x", 4, guided_grammar="root ::= foo"), timeout=60)
    assert r.status_code == 400 and 'Rule "foo" is not defined' in r.json()["error"]["message"], r.text
    assert "/project/" not in r.text and ".cc:" not in r.text


def test_compile_over_budget_is_a_400_and_is_remembered(hostile):
    """500 optional properties pass every size limit but take longer than the 3 s budget to compile here;
    the same schema again is refused at once (cached), and chats go on meanwhile."""
    fmt = _schema(500, "slow")
    with Probe(hostile.url) as probe:
        t0 = time.monotonic()
        r = httpx.post(hostile.v1 + "/chat/completions", json=_chat("x", 4, response_format=fmt), timeout=60)
        took = time.monotonic() - t0
    if r.status_code == 200:
        pytest.skip("this machine compiled 500 properties within the budget")
    assert r.status_code == 400 and "grammar_compile_timeout_s" in r.text, r.text
    assert took < LEVERS["grammar_compile_timeout_s"] + SLACK_S
    t0 = time.monotonic()
    again = httpx.post(hostile.v1 + "/chat/completions", json=_chat("x", 4, response_format=fmt), timeout=60)
    assert again.status_code == 400 and time.monotonic() - t0 < 1.0
    assert not probe.errors and max(probe.health, default=0) < HEALTH_S, (probe.errors, probe.health)


def test_a_client_that_leaves_kills_its_compile(hostile):
    workers = _state(hostile).engine.engine.structured.compiler.workers
    fmt = _schema(500, "gone")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(hostile.v1 + "/chat/completions", json=_chat("x", 4, response_format=fmt), timeout=0.8)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.5:  # the compile's process is killed as soon as the server sees the disconnect
        procs = [w.proc for w in list(workers._all)]
        if len(procs) == 1 and all(p.poll() is None for p in procs) and workers._free.qsize() == 1:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the compile of a client that left kept its worker")
    assert time.monotonic() - t0 < LEVERS["grammar_compile_timeout_s"] - 0.8


def test_an_ambiguous_grammar_is_stopped_by_the_mask_budget(hostile):
    """`s ::= s s | "a"` gets slower with every token; the matcher is stopped once one call passes
    grammar_mask_budget_ms (a 400 naming it), and chats alongside keep their pace."""
    eos = _state(hostile).engine.engine.eos_token_ids  # the grammar's stop tokens: banned, so it runs on
    body = _chat("a", 1500, guided_grammar='root ::= s\ns ::= s s | "a"', logit_bias={str(t): -100 for t in eos})
    with Probe(hostile.url) as probe:
        t0 = time.monotonic()
        r = httpx.post(hostile.v1 + "/chat/completions", json=body, timeout=300)
        took = time.monotonic() - t0
    assert r.status_code == 400 and "grammar_mask_budget_ms" in r.text, r.text[:500]
    assert r.json()["error"]["param"] == "guided_grammar"
    assert took < 60, took
    assert not probe.errors and max(probe.health, default=0) < HEALTH_S, (probe.errors, max(probe.health))
    assert _p95(probe.chats) < 2.0, f"chats beside the grammar slowed to p95 {_p95(probe.chats):.2f} s"


# ---- the event loop ------------------------------------------------------------------------------------
def test_huge_bad_words_and_stop_strings_are_refused_by_size(hostile):
    with Probe(hostile.url) as probe:
        for extra, param in (({"bad_words": ["x" * (8 << 20)]}, "bad_words"), ({"stop": ["y" * (1 << 20)]}, "stop")):
            t0 = time.monotonic()
            r = httpx.post(hostile.v1 + "/chat/completions", json=_chat("x", 4, **extra), timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text[:300]
            assert time.monotonic() - t0 < SLACK_S
    assert not probe.errors and max(probe.health) < HEALTH_S, (probe.errors, max(probe.health))


def test_a_large_response_is_built_off_the_loop(hostile):
    body = _chat("x", 200, n=16, logprobs=True, top_logprobs=20, ignore_eos=True, temperature=1.0, seed=1)
    with Probe(hostile.url) as probe:
        r = httpx.post(hostile.v1 + "/chat/completions", json=body, timeout=300)
    assert r.status_code == 200 and len(r.json()["choices"]) == 16
    assert not probe.errors and max(probe.health) < HEALTH_S, (probe.errors, max(probe.health))


# ---- the 5xx gone --------------------------------------------------------------------------------------
def test_deeply_nested_tool_arguments_are_a_400(hostile):
    deep = "[" * 100_000 + "]" * 100_000
    chat = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}], "max_tokens": 2}
    r = httpx.post(hostile.v1 + "/chat/completions", json=chat, timeout=60)
    assert r.status_code == 400, r.text[:300]
    resp = {"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": deep},
                      {"type": "function_call_output", "call_id": "c1", "output": "ok"}], "max_output_tokens": 2}
    r = httpx.post(hostile.v1 + "/responses", json=resp, timeout=60)
    assert r.status_code in (200, 400), r.text[:300]


def test_min_tokens_is_bounded_by_the_context(hostile):
    r = httpx.post(hostile.v1 + "/chat/completions", json=_chat("x", None, min_tokens=10**9), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text


def test_a_long_multipart_boundary_is_a_400():
    from qv.server.errors import APIError
    from qv.server.systemone import read_multipart

    with pytest.raises(APIError, match="RFC 2046"):
        read_multipart("multipart/form-data; boundary=" + "b" * 10_000, b"--" + b"b" * 10_000 + b"--\r\n", 2)


# ---- connections ---------------------------------------------------------------------------------------
def _raw(url: str, data: bytes, wait_s: float = 10.0) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait_s) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
            if b"\r\n\r\n" in out and b"content-length" in out.lower():
                break
        return out


def test_ambiguous_headers_are_a_400(hostile):
    dup = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer a\r\nAuthorization: Bearer b\r\n\r\n"
    assert _raw(hostile.url, dup).startswith(b"HTTP/1.1 400")
    body = b'{"prompt": "x", "max_tokens": 1}'
    smuggle = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 5\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
    assert _raw(hostile.url, smuggle).startswith(b"HTTP/1.1 400")


def test_silent_connections_are_closed_and_capped(hostile):
    host, port = hostile.url.removeprefix("http://").split(":")
    idle = [socket.create_connection((host, int(port)), timeout=10) for _ in range(3 * LEVERS["max_connections"])]
    try:
        refused = 0
        for s in idle[2 * LEVERS["max_connections"] + 4:]:  # past twice the cap: a 503 at once
            s.settimeout(5)
            refused += s.recv(4096).startswith(b"HTTP/1.1 503")
        assert refused >= LEVERS["max_connections"] - 8
        assert httpx.get(hostile.url + "/health", timeout=5).status_code in (200, 503)
        t0 = time.monotonic()
        s = idle[0]
        s.settimeout(LEVERS["header_read_timeout_s"] + SLACK_S)
        assert s.recv(4096) == b""  # closed by the header-read timeout
        assert time.monotonic() - t0 < LEVERS["header_read_timeout_s"] + SLACK_S
    finally:
        for s in idle:
            s.close()
    time.sleep(0.5)
    assert httpx.get(hostile.url + "/health", timeout=5).status_code == 200


def test_an_idle_keep_alive_connection_is_closed(hostile):
    host, port = hostile.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=LEVERS["keep_alive_timeout_s"] + SLACK_S) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        first = s.recv(65536)
        assert first.startswith(b"HTTP/1.1 200"), first
        t0 = time.monotonic()
        while s.recv(65536):
            pass
        assert time.monotonic() - t0 < LEVERS["keep_alive_timeout_s"] + SLACK_S


def test_a_stream_that_is_not_read_is_cut(hostile):
    """A client that sends a stream request and reads nothing: its output waits (coalesced, not
    queued step by step) and the stream is cut after stream_stall_timeout_s, aborting its request."""
    host, port = hostile.url.removeprefix("http://").split(":")
    body = json.dumps(_chat("x", 1900, stream=True, ignore_eos=True, logprobs=True, top_logprobs=20,
                            n=8, temperature=1.0, seed=3)).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((host, int(port)))
    try:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        engine = _state(hostile).engine
        stats = engine.engine.stats
        before, t0 = stats.generation_tokens, time.monotonic()
        while time.monotonic() - t0 < 120:
            if engine.stats().num_running == 0 and time.monotonic() - t0 > 1:
                break
            time.sleep(0.2)
        assert engine.stats().num_running == 0, "the stream nobody reads still holds its rows"
        made = stats.generation_tokens - before
        assert made < 8 * 1900 // 2, f"the stream ran to its end ({made} tokens) instead of being cut"
    finally:
        s.close()


def _unread_streams(url: str, engine, count: int) -> None:
    """`count` streams (n=8, 20 top logprobs, 1,900 tokens each) whose clients never read, until the
    engine holds none of them."""
    host, port = url.removeprefix("http://").split(":")
    socks = []
    try:
        for k in range(count):
            body = json.dumps(_chat(f"x{k}", 1900, stream=True, ignore_eos=True, logprobs=True, top_logprobs=20, n=8,
                                    temperature=1.0, seed=k)).encode()
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect((host, int(port)))
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            socks.append(s)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 240:
            if engine.stats().num_running == 0 and engine.stats().num_waiting == 0 and time.monotonic() - t0 > 1:
                break
            time.sleep(0.2)
        assert engine.stats().num_running == 0, "streams nobody reads still hold their rows"
    finally:
        for s in socks:
            s.close()


@pytest.mark.slow
def test_sixteen_unread_streams_keep_memory_bounded(hostile):
    """The issue's 16 streams whose clients never read: each is cut after stream_stall_timeout_s with
    its rows freed; meanwhile the server's RSS grows by less than 256 MiB (outputs merged, not queued
    step by step) and comes back within 10% once they are gone. A first round warms the engine's
    buffers for a batch of 128 rows (planned, not per request); the second is measured."""
    engine = _state(hostile).engine
    _unread_streams(hostile.url, engine, 16)
    proc = psutil.Process()
    gc.collect()
    rss0, peak = proc.memory_info().rss, [0]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        _unread_streams(hostile.url, engine, 16)
    finally:
        done.set()
        sampler.join()
    print(f"16 unread streams: RSS peak +{(peak[0] - rss0) / 2**20:.0f} MiB")
    assert peak[0] - rss0 < 256 << 20, f"peak +{(peak[0] - rss0) / 2**20:.0f} MiB"
    gc.collect()
    assert proc.memory_info().rss < rss0 * 1.10


# ---- images --------------------------------------------------------------------------------------------
def test_images_outside_the_allow_list_never_reach_a_decoder(tmp_path, monkeypatch):
    from qv.engine.media import MediaError, decode_image, open_media

    log = tmp_path / "gs.log"
    gs = tmp_path / "gs"
    gs.write_text(f"#!/bin/sh\necho ran >> {log}\nexit 1\n")
    gs.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n0 0 moveto 10 10 lineto stroke\nshowpage\n"
    with pytest.raises(MediaError, match="EPS images are not read here"):
        decode_image(open_media(eps, "image"))
    assert not log.exists(), "an external program ran on the request's bytes"


def test_an_eps_data_url_runs_nothing(hostile, tmp_path, monkeypatch):
    """The 117-byte EPS of the issue as a chat image: a 400 naming the format, and the `gs` on PATH
    (which logs every run) never runs."""
    import base64

    log = tmp_path / "gs.log"
    gs = tmp_path / "gs"
    gs.write_text(f"#!/bin/sh\necho ran >> {log}\nexit 1\n")
    gs.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")  # the server runs in this process
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n0 0 moveto 10 10 lineto stroke\nshowpage\n"
    url = "data:image/png;base64," + base64.b64encode(eps).decode()
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"},
                                                      {"type": "image_url", "image_url": {"url": url}}]}],
            "max_tokens": 2}
    r = httpx.post(hostile.v1 + "/chat/completions", json=chat, timeout=60)
    vision = "vision_config" in json.loads((Path(hostile.model_dir) / "config.json").read_text())
    assert r.status_code == 400, r.text
    assert "EPS" in r.json()["error"]["message"] or not vision, r.text  # a text-only model refuses any image first
    assert not log.exists(), "an external program ran on the request's bytes"


def test_a_long_multipart_boundary_is_a_400_over_http(hostile):
    b = "b" * 10_000
    body = f"--{b}\r\nContent-Disposition: form-data; name=\"request\"\r\n\r\n{{}}\r\n--{b}--\r\n".encode()
    r = httpx.post(hostile.v1 + "/systemone", content=body, timeout=60,
                   headers={"Content-Type": f"multipart/form-data; boundary={b}"})
    assert r.status_code == 400 and "RFC 2046" in r.text, r.text[:300]


def _clef_body(mb: int) -> bytes:
    return json.dumps({"model": "clef", "state": {"a": 1}, "questions": {"q": {
        "type": "choice", "instructions": "word " * ((mb << 20) // 5), "criteria": {"yes": "y", "no": "n"}}}}).encode()


def test_two_28_mb_clef_bodies_cost_under_1_gb(hostile):
    """Two 28 MB `instructions` at once over HTTP: 413 naming clef_max_body_bytes, unparsed (their
    Content-Length says enough); the server's RSS (sampled every 10 ms) rises by less than 1 GiB and
    comes back within 10%, /health stays fast."""
    proc, body, peak, rss0 = psutil.Process(), _clef_body(28), [0], 0
    gc.collect()
    rss0 = proc.memory_info().rss
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.01)

    statuses = []

    def send():
        r = httpx.post(hostile.v1 + "/systemone", content=body, headers={"Content-Type": "application/json"},
                       timeout=120)
        statuses.append((r.status_code, r.text[:300]))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    with Probe(hostile.url) as probe:
        senders = [threading.Thread(target=send) for _ in range(2)]
        for t in senders:
            t.start()
        for t in senders:
            t.join()
    done.set()
    sampler.join()
    assert all(code == 413 and "clef_max_body_bytes" in text for code, text in statuses), statuses
    print(f"two 28 MB Clef bodies: RSS peak +{(peak[0] - rss0) / 2**20:.0f} MiB")
    assert peak[0] - rss0 < 1 << 30, f"peak +{(peak[0] - rss0) / 2**20:.0f} MiB"
    assert not probe.errors and max(probe.health) < HEALTH_S, (probe.errors, max(probe.health))
    body = None
    gc.collect()
    assert proc.memory_info().rss < rss0 * 1.10


def test_a_chunked_clef_body_over_its_cap_is_refused_before_it_ends(hostile):
    """A chunked /v1/systemone body (no Content-Length) that passes clef_max_body_bytes: the server
    answers 413 naming the lever while the client has not finished sending (no closing chunk is ever
    sent): it was refused as it arrived, never waited for whole, let alone parsed."""
    cap = _state(hostile).clef_body_limit[0]
    host, port = hostile.url.removeprefix("http://").split(":")
    chunk = b"x" * (1 << 20)
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n")
        sent = 0
        try:
            while sent <= cap + (2 << 20):
                s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed while this was still sending
        answer = b""
        while b"\r\n\r\n" not in answer and (part := s.recv(65536)):
            answer += part
        while b"clef_max_body_bytes" not in answer and (part := s.recv(65536)):
            answer += part
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"clef_max_body_bytes" in answer and str(cap).encode() in answer


# ---- memory --------------------------------------------------------------------------------------------
def test_two_huge_clef_bodies_are_refused_by_size(tiny_model):
    """Two 28 MB `instructions` at once: refused by their size before tokenizing, each in well under 1 GB."""
    import tracemalloc

    from transformers import AutoTokenizer

    from qv.clef.request import ClefRequestError, encode_request, validate
    from qv.engine.request import TextBound

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    bound = TextBound.of(tok)
    assert bound is not None
    body = json.dumps({"model": "clef", "state": {"a": 1}, "questions": {"q": {
        "type": "choice", "instructions": "word " * ((28 << 20) // 5), "criteria": {"yes": "y", "no": "n"}}}}).encode()
    errors = []

    def one():
        try:
            encode_request(tok, validate(body), 34816, max_chars_per_token=bound.max_token_bytes * bound.shrink)
        except ClefRequestError as exc:
            errors.append(exc)

    tracemalloc.start()
    threads = [threading.Thread(target=one) for _ in range(2)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(errors) == 2 and all("Clef record cap" in str(e) for e in errors), errors
    assert peak < 1 << 30, f"peak {peak / 2**20:.0f} MiB"
    assert time.monotonic() - t0 < 30


def test_a_state_of_millions_of_objects_is_refused_before_parsing():
    from qv.clef.request import ClefRequestError, validate

    body = b'{"model": "clef", "questions": {}, "state": [' + b"{}," * 10_000_000 + b"{}]}"
    t0 = time.monotonic()
    with pytest.raises(ClefRequestError, match="JSON objects and arrays"):
        validate(body)
    assert time.monotonic() - t0 < SLACK_S


# ---- the load test -------------------------------------------------------------------------------------
@pytest.mark.slow
def test_hostile_load(hostile):
    """Each attack class while a probe sends small chats: no 5xx, each attack answered or refused within
    its budget plus slack, the probe's p95 within 3x its unloaded value (+1 s on a loaded 2-core
    machine), /health under 0.5 s, and RSS back within 10% of where it started."""
    rng = random.Random(40)
    proc = psutil.Process()
    with Probe(hostile.url) as quiet:
        time.sleep(5)
    base_chat = _p95(quiet.chats)
    print(f"unloaded: /health max {max(quiet.health) * 1000:.1f} ms, chat p95 {base_chat * 1000:.0f} ms")
    gc.collect()
    rss0 = proc.memory_info().rss
    attacks = {
        "schema": lambda c: c.post("/v1/chat/completions", json=_chat("x", 4, response_format=_schema(
            rng.randrange(400, 500), f"h{rng.randrange(1 << 30)}"))),
        "choices": lambda c: c.post("/v1/chat/completions", json=_chat("x", 4, guided_choice=[
            str(i) for i in range(100_000)])),
        "bad_words": lambda c: c.post("/v1/chat/completions", json=_chat("x", 4, bad_words=["z" * (8 << 20)])),
        "big_response": lambda c: c.post("/v1/chat/completions", json=_chat(
            "x", 100, n=16, logprobs=True, top_logprobs=20, ignore_eos=True, temperature=1.0, seed=2)),
        "nested_args": lambda c: c.post("/v1/chat/completions", json={"messages": [
            {"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * 50_000}}]}],
            "max_tokens": 2}),
        "min_tokens": lambda c: c.post("/v1/chat/completions", json=_chat("x", None, min_tokens=10**9)),
        "clef_instructions": lambda c: c.post("/v1/systemone", content=_clef_body(28),
                                              headers={"Content-Type": "application/json"}),
        "clef_state": lambda c: c.post("/v1/systemone", content=b'{"model": "clef", "questions": {}, "state": ['
                                       + b"{}," * 10_000_000 + b"{}]}", headers={"Content-Type": "application/json"}),
    }
    budget = {"schema": LEVERS["grammar_compile_timeout_s"]}
    for name, attack in attacks.items():
        with Probe(hostile.url) as probe, httpx.Client(base_url=hostile.url, timeout=300) as c:
            for _ in range(3):
                t0 = time.monotonic()
                r = attack(c)
                took = time.monotonic() - t0
                assert r.status_code < 500, (name, r.status_code, r.text[:300])
                assert took < budget.get(name, 0) + SLACK_S + 10, (name, took)
        assert not probe.errors, (name, probe.errors)
        assert max(probe.health) < HEALTH_S, (name, max(probe.health))
        assert _p95(probe.chats) < 3 * base_chat + 1.0, (name, _p95(probe.chats), base_chat)
        gc.collect()
        rss = proc.memory_info().rss
        assert rss < rss0 * 1.10, (name, rss / 2**20, rss0 / 2**20)
