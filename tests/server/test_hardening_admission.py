"""Admission that one client cannot monopolise: max_waiting counts the sequences (prompts x n) of the
whole request when it is admitted, including requests admitted a moment ago that the engine's gauge
has not counted yet; max_prompts_per_request and max_stop_strings cap one request; a request that
would pass the limit gets 503 with Retry-After while the other clients keep being served."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from conftest import start_server

MAX_WAITING = 16


@pytest.fixture(scope="module")
def narrow(tiny_model):
    """One sequence runs at a time and 16 may wait; up to 500 prompts in a request."""
    running, stop = start_server(tiny_model, max_num_seqs=1, max_waiting=MAX_WAITING, max_prompts_per_request=500)
    yield running
    stop()


def test_500_prompts_times_8_is_refused_by_the_prompt_cap(server):
    body = {"prompt": [f"prompt {i}" for i in range(500)], "n": 8, "max_tokens": 2}
    r = httpx.post(server.v1 + "/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert "500 prompts" in r.json()["error"]["message"] and "max_prompts_per_request" in r.text
    r = httpx.post(server.v1 + "/completions", json={"prompt": "still served", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200


def test_stop_string_cap(server):
    ok = {"prompt": "x", "max_tokens": 2, "stop": [f"s{i}" for i in range(64)]}
    assert httpx.post(server.v1 + "/completions", json=ok, timeout=60).status_code == 200
    r = httpx.post(server.v1 + "/completions", json=dict(ok, stop=ok["stop"] + ["one more"]), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text
    assert "65 stop strings" in r.json()["error"]["message"] and "max_stop_strings" in r.text


def test_500_prompts_times_8_needs_more_than_max_waiting(narrow):
    """Within the prompt cap but 4000 sequences: never admissible here, so a 400 naming max_waiting
    (a 503 would send the client into retrying forever); a small request is served beside it."""
    body = {"prompt": [f"prompt {i}" for i in range(500)], "n": 8, "max_tokens": 2}
    r = httpx.post(narrow.v1 + "/completions", json=body, timeout=60)
    assert r.status_code == 400 and "4000 sequences" in r.json()["error"]["message"], r.text
    assert "max_waiting" in r.text
    r = httpx.post(narrow.v1 + "/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                          "n": MAX_WAITING + 1, "max_tokens": 2}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    r = httpx.post(narrow.v1 + "/completions", json={"prompt": "small", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200


async def _open_stream(http: httpx.AsyncClient, body: dict):
    """Start a streaming completion; returns (status, headers, open response or None)."""
    req = http.build_request("POST", "/v1/completions", json=body)
    r = await http.send(req, stream=True)
    if r.status_code != 200:
        await r.aread()
        await r.aclose()
        return r.status_code, r.headers, None
    return 200, r.headers, r


def test_a_burst_cannot_queue_past_max_waiting(narrow):
    """Ten requests of 4 prompts x n=2 (8 sequences) arrive at once. Only two fit in 16 seats; the
    engine's waiting gauge lags behind such a burst, so the seats this server has handed out count
    too. The rest get 503 + Retry-After, a one-sequence client is still admitted, and it is served
    once the burst is dropped."""
    long = {"prompt": ["a", "b", "c", "d"], "n": 2, "max_tokens": 400, "ignore_eos": True, "stream": True}

    async def scenario():
        limits = httpx.Limits(max_connections=32, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=narrow.url, timeout=120, limits=limits) as http:
            results = await asyncio.gather(*(_open_stream(http, dict(long, seed=i)) for i in range(10)))
            admitted = [r for status, _, r in results if status == 200]
            refused = [h for status, h, _ in results if status == 503]
            waiting = narrow.metric("vllm:num_requests_waiting")
            tokens = narrow.metric("vllm:generation_tokens_total")
            while narrow.metric("vllm:generation_tokens_total") < tokens + 5:
                await asyncio.sleep(0.05)
            unstarted = narrow.app.state.qv.unstarted  # one prompt (n=2) has started: its 2 seats came back
            status, _, small = await _open_stream(http, {"prompt": "small", "max_tokens": 3, "ignore_eos": True,
                                                         "stream": True})
            for r in admitted:  # the burst's clients hang up: their requests are aborted
                await r.aclose()
            text = "" if small is None else (await small.aread()).decode()
            return len(admitted), refused, waiting, unstarted, status, text

    n_admitted, refused, waiting, unstarted, small_status, small_text = asyncio.run(scenario())
    assert n_admitted == 2 and len(refused) == 8, (n_admitted, len(refused))
    assert all(h["retry-after"] == "1" for h in refused)
    assert waiting <= MAX_WAITING and unstarted == 2 * 8 - 2, (waiting, unstarted)
    assert small_status == 200 and small_text.rstrip().endswith("data: [DONE]"), small_text[-300:]
    assert '"finish_reason":"length"' in small_text
    deadline = time.time() + 30
    while narrow.metric("vllm:num_requests_running") + narrow.metric("vllm:num_requests_waiting") > 0:
        assert time.time() < deadline, "the dropped burst was not aborted"
        time.sleep(0.05)
    assert narrow.app.state.qv.unstarted == 0  # every seat handed out came back
