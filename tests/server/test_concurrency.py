"""64 concurrent streaming clients (chat and completions, mixed lengths); a quarter hang up
mid-stream. Every finished client gets exactly its token count; every hung-up request is aborted
(the engine's abort counter rises by exactly that many, running and waiting return to 0); the
server stays healthy and serves the next request."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx

N_CLIENTS = 64


async def _client(http: httpx.AsyncClient, i: int, rng: random.Random) -> dict:
    chat = i % 2 == 0
    hang_up = i % 4 == 3
    max_tokens = 64 if hang_up else rng.randint(1, 24)
    body = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.8, "seed": i, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}
    if chat:
        body["messages"] = [{"role": "user", "content": f"Client {i} says hello " * (1 + i % 5)}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = f"Prompt number {i}: " + "tokens " * (i % 7)
        path = "/v1/completions"
    events, ids, finish, usage = [], 0, None, None
    async with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if line == "data: [DONE]":
                break
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if chunk["choices"]:
                ch = chunk["choices"][0]
                ids += len(ch.get("token_ids") or [])
                finish = ch["finish_reason"] or finish
            else:
                usage = chunk["usage"]
            if hang_up and ids >= 3:
                break  # leaving the block closes the connection mid-stream
    return {"i": i, "chat": chat, "hang_up": hang_up, "max_tokens": max_tokens, "ids": ids, "finish": finish,
            "usage": usage, "events": events}


async def _run_all(url: str) -> list[dict]:
    rng = random.Random(1234)
    limits = httpx.Limits(max_connections=N_CLIENTS + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as http:
        return await asyncio.gather(*(_client(http, i, rng) for i in range(N_CLIENTS)))


def test_64_concurrent_streams_with_hang_ups(server):
    aborted_before = server.metric("vllm:request_success_total", finished_reason="abort")
    t0 = time.time()
    results = asyncio.run(_run_all(server.url))
    finished = [r for r in results if not r["hang_up"]]
    hung_up = [r for r in results if r["hang_up"]]
    assert len(finished) == 48 and len(hung_up) == 16
    for r in finished:
        where = f"client {r['i']}"
        assert r["events"][-1] == "[DONE]", where
        assert r["ids"] == r["max_tokens"], where
        assert r["usage"]["completion_tokens"] == r["max_tokens"], where
        assert r["finish"] == "length", where
        if r["chat"]:
            assert json.loads(r["events"][0])["choices"][0]["delta"]["role"] == "assistant", where
    for r in hung_up:
        assert 3 <= r["ids"] < r["max_tokens"] and r["usage"] is None
    deadline = time.time() + 30
    while server.metric("vllm:num_requests_running") + server.metric("vllm:num_requests_waiting") > 0:
        assert time.time() < deadline, "requests are still running after every client finished or hung up"
        time.sleep(0.05)
    assert server.metric("vllm:request_success_total", finished_reason="abort") == aborted_before + len(hung_up)
    assert server.metric("vllm:kv_cache_usage_perc") == 0
    with server.client() as c:
        assert c.get("/health").status_code == 200
        r = c.post("/v1/completions", json={"prompt": "still alive", "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    print(f"64 streams in {time.time() - t0:.1f}s")


def test_non_streaming_client_that_gives_up_is_aborted(server):
    aborted = server.metric("vllm:request_success_total", finished_reason="abort")
    body = {"prompt": "long", "max_tokens": 800, "ignore_eos": True}
    try:
        httpx.post(server.v1 + "/completions", json=body, timeout=1.5)
        raise AssertionError("an 800-token request finished within 1.5 s")
    except httpx.ReadTimeout:
        pass  # the client closes the connection
    deadline = time.time() + 30
    while server.metric("vllm:request_success_total", finished_reason="abort") < aborted + 1:
        assert time.time() < deadline, "the abandoned request was not aborted"
        time.sleep(0.05)
    tokens = server.metric("vllm:generation_tokens_total")
    time.sleep(0.5)
    assert server.metric("vllm:generation_tokens_total") == tokens  # nothing is generating for nobody
