"""LoRA adapters over HTTP with vLLM's interface: `model` selects an adapter (completions, streamed
chat), /v1/models lists adapters with their parent, /v1/load_lora_adapter and /v1/unload_lora_adapter
change the set at run time only behind the runtime-update lever, and a bad adapter gets a clear 400
while the others keep serving. (The numbers themselves are proven against transformers with the
adapter merged in tests/engine/test_lora.py.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from lora_fixtures import write_adapters  # noqa: E402
from server.conftest import start_server  # noqa: E402


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    return write_adapters(tiny_model, tmp_path_factory.mktemp("lora"))


@pytest.fixture(scope="module")
def lora_server(tiny_model, adapters):
    running, stop = start_server(tiny_model, enable_lora=True, lora_modules=f"attn={adapters['attn']}",
                                 max_loras=2, max_lora_rank=16, allow_runtime_lora_updating=True)
    yield running
    stop()


def _complete(c, model: str) -> str:
    r = c.post("/v1/completions", json={"model": model, "prompt": "Hello there", "max_tokens": 8, "temperature": 0,
                                        "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == model  # vLLM names the adapter
    return r.json()["choices"][0]["text"]


def _chat_stream(c, model: str) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0,
            "stream": True, "ignore_eos": True}
    text = ""
    with c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for ch in json.loads(line[6:])["choices"]:
                    text += (ch["delta"].get("content") or "") + (ch["delta"].get("reasoning_content") or "")
    return text


def test_models_list_adapters_with_parent(lora_server):
    with lora_server.client() as c:
        data = c.get("/v1/models").json()["data"]
        base = data[0]["id"]
        attn = next(m for m in data if m["id"] == "attn")
        assert attn["parent"] == base and attn["root"].endswith("attn")
        assert c.get("/v1/models/attn").json()["parent"] == base


def test_model_selects_the_adapter(lora_server, adapters):
    with lora_server.client() as c:
        base = c.get("/v1/models").json()["data"][0]["id"]
        plain, tuned = _complete(c, base), _complete(c, "attn")
        assert plain != tuned, "the adapter changed nothing"
        stream_plain, stream_tuned = _chat_stream(c, base), _chat_stream(c, "attn")
        assert stream_plain != stream_tuned
        # the same folder loaded at run time under another name answers the same
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "attn2", "lora_path": str(adapters["attn"])})
        assert r.status_code == 200, r.text
        assert _complete(c, "attn2") == tuned and _chat_stream(c, "attn2") == stream_tuned
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "attn2"}).status_code == 200
        r = c.post("/v1/completions", json={"model": "attn2", "prompt": "x", "max_tokens": 1})
        assert r.status_code == 404
        assert "attn2" not in [m["id"] for m in c.get("/v1/models").json()["data"]]


def test_bad_adapters_get_a_clear_400(lora_server, adapters, tmp_path):
    big = tmp_path / "big"
    big.mkdir()
    cfg = json.loads((adapters["every"] / "adapter_config.json").read_text())
    cfg["r"] = 32
    (big / "adapter_config.json").write_text(json.dumps(cfg))
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(adapters["every"] / "adapter_model.safetensors"))
    save_file({k: (v.repeat(2, 1) if "lora_A" in k else v.repeat(1, 2)).contiguous() for k, v in tensors.items()},
              str(big / "adapter_model.safetensors"))
    cases = {"missing": (tmp_path / "nowhere", "no such folder"), "big": (big, "above max_lora_rank 16"),
             "nofile": (tmp_path, "adapter_config.json")}
    with lora_server.client() as c:
        for name, (path, why) in cases.items():
            r = c.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
            assert r.status_code == 400 and why in r.json()["error"]["message"], (name, r.text)
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "attn", "lora_path": str(adapters["gdn"])})
        assert r.status_code == 400 and "already loaded" in r.json()["error"]["message"]
        r = c.post("/v1/unload_lora_adapter", json={"lora_name": "nope"})
        assert r.status_code == 404
        assert _complete(c, "attn")  # still serving


def test_runtime_updates_are_off_by_default(tiny_model, adapters):
    running, stop = start_server(tiny_model, enable_lora=True, lora_modules=f"attn={adapters['attn']}")
    try:
        with running.client() as c:
            r = c.post("/v1/load_lora_adapter", json={"lora_name": "g", "lora_path": str(adapters["gdn"])})
            assert r.status_code == 400 and "ALLOW_RUNTIME_LORA_UPDATING" in r.json()["error"]["message"]
            assert _complete(c, "attn")
    finally:
        stop()
