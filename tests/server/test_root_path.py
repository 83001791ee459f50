"""`--root-path` (vLLM's, uvicorn's root_path): behind a proxy that strips the prefix, routes and the
API key's scope match the path without it, and the playground's page is served at the prefix's root."""

from __future__ import annotations

import httpx
import pytest

from conftest import start_server

KEY = "root-path-key"


@pytest.fixture(scope="module")
def prefixed(tiny_model):
    running, stop = start_server(tiny_model, qv_connections=True, root_path="/qv", api_key=KEY)
    yield running
    stop()


def test_the_key_guards_v1_under_a_root_path(prefixed):
    assert httpx.get(prefixed.url + "/v1/models", timeout=30).status_code == 401
    r = httpx.get(prefixed.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 200 and r.json()["data"], r.text


def test_open_routes_and_the_playground_stay_open(prefixed):
    assert httpx.get(prefixed.url + "/health", timeout=30).status_code == 200
    page = httpx.get(prefixed.url + "/", timeout=30)
    assert page.status_code == 200 and "<html" in page.text.lower()


def test_a_chat_under_the_root_path(prefixed):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
    r = httpx.post(prefixed.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                   timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"] is not None, r.text
