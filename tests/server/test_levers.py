"""Server levers on a second server: API key under api_key_scope all (401 on every route but /health
and /ping; /metrics opened by metrics_public; vLLM's default scope: test_vllm_edges.py), body limit (413), waiting-queue bound (503 + Retry-After), served-name aliases, the
enable_thinking default, and /health once the engine is gone."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from conftest import start_server

MSG = [{"role": "user", "content": "hi"}]
AUTH = {"Authorization": "Bearer sekret"}


def chat(**kw):
    return dict({"messages": MSG, "max_tokens": 4}, **kw)


@pytest.fixture(scope="module")
def guarded(tiny_model):
    running, stop = start_server(tiny_model, api_key="sekret", api_key_scope="all", metrics_public=True, max_body_bytes=4096, max_waiting=1,
                                 max_num_seqs=1, enable_thinking=True, served_model_name="qwen-a, qwen-b")
    yield running
    stop()


def test_api_key(guarded):
    good = AUTH
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
        r = httpx.post(guarded.v1 + "/chat/completions", json=chat(), headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
        assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.post(guarded.v1 + "/chat/completions", json=chat(), headers=good).status_code == 200
    for method, path, body in (("GET", "/v1/models", None), ("GET", "/version", None),
                               ("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [1]}),
                               ("POST", "/reset_prefix_cache", None), ("POST", "/v1/completions", {"prompt": "x"}),
                               ("POST", "/v1/responses", {"input": "x"}), ("GET", "/v1/nowhere", None),
                               ("POST", "/invocations", chat()), ("GET", "/openapi.json", None)):
        r = httpx.request(method, guarded.url + path, json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == 401, (path, r.text)
        r = httpx.request(method, guarded.url + path, json=body, headers=good)
        assert r.status_code in (200, 404), (path, r.text)  # the unknown route is a 404 once the key is right
    assert httpx.get(guarded.url + "/health").status_code == 200  # the health probes need no key
    assert httpx.get(guarded.url + "/ping").status_code == 200 and httpx.post(guarded.url + "/ping").status_code == 200
    assert httpx.get(guarded.url + "/metrics").status_code == 200  # metrics_public opens it for a scraper


def test_body_too_large(guarded):
    good = AUTH
    big = chat(messages=[{"role": "user", "content": "x" * 5000}])
    r = httpx.post(guarded.v1 + "/chat/completions", json=big, headers=good)
    assert r.status_code == 413 and r.json()["error"]["code"] == 413

    def chunks():  # no Content-Length: the limit is enforced while reading
        yield json.dumps(big).encode()

    r = httpx.post(guarded.v1 + "/chat/completions", content=chunks(), headers=dict(good, **{"content-type": "application/json"}))
    assert r.status_code == 413


def test_waiting_queue_bound_gives_503(guarded):
    """max_num_seqs=1, max_waiting=1: one request runs, one waits, the next is refused with 503.
    Both streams are then dropped, which aborts the running and the waiting request alike."""
    good = AUTH
    long = chat(max_tokens=400, ignore_eos=True, temperature=0, stream=True)
    aborted_before = guarded.metric("vllm:request_success_total", finished_reason="abort")
    with httpx.Client(headers=good, timeout=60) as c1, httpx.Client(headers=good, timeout=60) as c2:
        with c1.stream("POST", guarded.v1 + "/chat/completions", json=long) as r1:
            assert r1.status_code == 200
            deadline = time.time() + 60
            while guarded.metric("vllm:num_requests_running") < 1:  # else the second would find it waiting
                assert time.time() < deadline, "the first request never ran"
                time.sleep(0.05)
            with c2.stream("POST", guarded.v1 + "/chat/completions", json=long) as r2:
                assert r2.status_code == 200
                while guarded.metric("vllm:num_requests_waiting") < 1:
                    assert time.time() < deadline, "the second request never queued"
                    time.sleep(0.05)
                r = httpx.post(guarded.v1 + "/chat/completions", json=chat(), headers=good)
                assert r.status_code == 503, r.text
                assert r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "ServiceUnavailableError"
                assert "busy" in r.json()["error"]["message"]
                assert guarded.metric("vllm:admission_rejections_total") == 1
    deadline = time.time() + 15
    while guarded.metric("vllm:num_requests_running") + guarded.metric("vllm:num_requests_waiting") > 0:
        assert time.time() < deadline, "dropped streams were not aborted"
        time.sleep(0.05)
    assert guarded.metric("vllm:request_success_total", finished_reason="abort") == aborted_before + 2
    r = httpx.post(guarded.v1 + "/chat/completions", json=chat(), headers=good)
    assert r.status_code == 200


def test_served_name_aliases(guarded):
    models = httpx.get(guarded.v1 + "/models", headers=AUTH).json()
    assert [m["id"] for m in models["data"]] == ["qwen-a", "qwen-b"]
    assert [m["name"] for m in models["models"]] == ["qwen-a", "qwen-b"]
    r = httpx.post(guarded.v1 + "/chat/completions", json=chat(model="qwen-b", temperature=0), headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json()["model"] == "qwen-a"
    r = httpx.post(guarded.v1 + "/chat/completions", json=chat(model="tiny-0-0"), headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_enable_thinking_lever_is_the_default(guarded):
    ids = httpx.post(guarded.url + "/tokenize", json={"messages": MSG}, headers=AUTH).json()["tokens"]
    prompt = httpx.post(guarded.url + "/detokenize", json={"tokens": ids}, headers=AUTH).json()["prompt"]
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")
    on = httpx.post(guarded.v1 + "/chat/completions", json=chat(temperature=0, ignore_eos=True), headers=AUTH,
                    timeout=60).json()["choices"][0]["message"]
    assert on["reasoning"] and on["content"] is None
    off = httpx.post(guarded.v1 + "/chat/completions", json=chat(temperature=0, ignore_eos=True,
                     chat_template_kwargs={"enable_thinking": False}), headers=AUTH, timeout=60).json()
    assert off["choices"][0]["message"]["content"] and off["choices"][0]["message"]["reasoning"] is None


def test_health_503_once_the_engine_is_gone(guarded):
    """Last in this module: stops the engine thread."""
    assert httpx.get(guarded.url + "/health").status_code == 200
    guarded.app.state.qv.engine.shutdown()
    r = httpx.get(guarded.url + "/health")
    assert r.status_code == 503 and r.json()["error"]["code"] == 503
    r = httpx.post(guarded.v1 + "/chat/completions", json=chat(), headers=AUTH)
    assert r.status_code == 503 and "not running" in r.json()["error"]["message"]
    r = httpx.post(guarded.url + "/reset_prefix_cache", headers=AUTH, timeout=10)  # answered, not left hanging
    assert r.status_code == 503 and "not running" in r.json()["error"]["message"]
