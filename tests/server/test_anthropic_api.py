"""The Anthropic Messages API (/v1/messages, /v1/messages/count_tokens) through the official
`anthropic` SDK against the real server on the tiny model: the same greedy output as the chat path on
the same conversation, Anthropic's stream event order, tools, images, thinking, token counts, and
Anthropic-shaped errors."""

from __future__ import annotations

import base64
import io
import json
import re
import shlex
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import anthropic
import httpx
import jsonschema
import numpy as np
import pytest
from conftest import start_server
from PIL import Image

GREEDY = {"temperature": 0}  # the SDK no longer has a temperature argument; the API still takes it
TOOLS = [{"name": "get_weather", "description": "The weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                                                    "days": {"type": "integer", "maximum": 9}},
                           "required": ["city", "days"]}}]
USER = [{"role": "user", "content": "Name a colour."}]
KEY = "anthropic-test-key"


def png(seed: int = 0, w: int = 32, h: int = 24) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def model(server) -> str:
    return httpx.get(server.v1 + "/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def chat(server, model, messages, **kw) -> dict:
    r = httpx.post(server.v1 + "/chat/completions", json=dict(model=model, messages=messages, temperature=0, **kw),
                   timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def prompt_tokens(usage) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def raw_events(server, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of every SSE event, as sent."""
    with httpx.stream("POST", server.url + "/v1/messages", json=dict(body, stream=True), timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    events = []
    for frame in text.strip().split("\n\n"):
        lines = frame.split("\n")
        assert lines[0].startswith("event: ") and lines[1].startswith("data: "), frame
        events.append((lines[0][7:], json.loads(lines[1][6:])))
    return events


def without_id(message) -> dict:
    """The message without its ids, its usage as prompt and output tokens."""
    d = message.model_dump(exclude_none=True)
    d.pop("id")
    d["usage"] = {"prompt": prompt_tokens(message.usage), "output": message.usage.output_tokens}  # cache aside
    for block in d["content"]:
        block.pop("parsed_output", None)  # the stream helper's ParsedTextBlock field
        if block["type"] == "tool_use":
            block.pop("id")
    return d


def test_plain_message_equals_the_chat_path(client, server, model):
    m = client.messages.create(model=model, max_tokens=12, messages=USER, extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.model == model and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"]
    c = chat(server, model, USER, max_tokens=12)
    assert m.content[0].text == c["choices"][0]["message"]["content"]
    assert m.usage.output_tokens == c["usage"]["completion_tokens"]
    assert prompt_tokens(m.usage) == c["usage"]["prompt_tokens"]
    reason = {"length": "max_tokens", "stop": "end_turn"}[c["choices"][0]["finish_reason"]]
    assert m.stop_reason == reason and m.stop_sequence is None


def test_assistant_prefill_is_continued(client, server, model):
    turns = USER + [{"role": "assistant", "content": "The colour is"}]
    m = client.messages.create(model=model, max_tokens=6, messages=turns, extra_body=GREEDY)
    c = chat(server, model, turns, max_tokens=6, add_generation_prompt=False, continue_final_message=True)
    assert m.content[0].text == c["choices"][0]["message"]["content"]
    assert prompt_tokens(m.usage) == c["usage"]["prompt_tokens"]
    opened = chat(server, model, turns, max_tokens=6)
    assert opened["usage"]["prompt_tokens"] != c["usage"]["prompt_tokens"]  # not a new assistant turn


def test_system_prompt_string_and_blocks(client, server, model):
    system = "You are terse."
    as_text = client.messages.create(model=model, max_tokens=8, system=system, messages=USER, extra_body=GREEDY)
    blocks = [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}]
    as_blocks = client.messages.create(model=model, max_tokens=8, messages=USER, extra_body=GREEDY, system=blocks)
    c = chat(server, model, [{"role": "system", "content": system}] + USER, max_tokens=8)
    assert as_text.content[0].text == as_blocks.content[0].text == c["choices"][0]["message"]["content"]
    assert prompt_tokens(as_text.usage) == prompt_tokens(as_blocks.usage) == c["usage"]["prompt_tokens"]
    plain = client.messages.count_tokens(model=model, messages=USER).input_tokens
    assert prompt_tokens(as_text.usage) > plain


def test_stream_event_order_and_final_message(client, server, model):
    body = {"model": model, "max_tokens": 10, "messages": USER, **GREEDY}
    whole = client.messages.create(**{k: v for k, v in body.items() if k != "temperature"}, extra_body=GREEDY)
    events = raw_events(server, body)
    names = [name for name, _ in events]
    assert all(data["type"] == name for name, data in events)
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    deltas = [d["delta"] for n, d in events if n == "content_block_delta"]
    assert all(d["type"] == "text_delta" for d in deltas)
    assert "".join(d["text"] for d in deltas) == whole.content[0].text
    final = events[-2][1]
    assert final["delta"]["stop_reason"] == whole.stop_reason
    assert final["usage"]["output_tokens"] == whole.usage.output_tokens
    with client.messages.stream(model=model, max_tokens=10, messages=USER, extra_body=GREEDY) as s:
        kinds = [e.type for e in s]
        streamed = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert without_id(streamed) == without_id(whole)


def test_forced_tool_use_and_its_stream(client, model):
    kw = dict(model=model, max_tokens=200, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
              tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    m = client.messages.create(**kw)
    assert m.stop_reason == "tool_use"
    uses = [b for b in m.content if b.type == "tool_use"]
    assert uses and uses[0].name == "get_weather"
    assert isinstance(uses[0].input["city"], str) and isinstance(uses[0].input["days"], int)  # the call grammar
    with client.messages.stream(**kw) as s:
        kinds = [e.type for e in s]
        streamed = s.get_final_message()
    assert "input_json" in kinds  # the SDK's event for input_json_delta
    assert without_id(streamed) == without_id(m)
    any_tool = client.messages.create(**dict(kw, tool_choice={"type": "any", "disable_parallel_tool_use": True}))
    assert any_tool.stop_reason == "tool_use" and [b.type for b in any_tool.content].count("tool_use") == 1


def test_tool_result_turn_equals_the_chat_path(client, server, model):
    turns = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": [
                 {"type": "text", "text": "Let me look."},
                 {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "days": 1}}]},
             {"role": "user", "content": [
                 {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "Sunny, 21C"}]},
                 {"type": "text", "text": "And tomorrow?"}]}]
    m = client.messages.create(model=model, max_tokens=8, messages=turns, tools=TOOLS, extra_body=GREEDY)
    c = chat(server, model, [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 1})}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny, 21C"},
        {"role": "user", "content": "And tomorrow?"}],
        max_tokens=8, tools=[{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                               "parameters": t["input_schema"]}} for t in TOOLS])
    assert prompt_tokens(m.usage) == c["usage"]["prompt_tokens"]
    text = "".join(b.text for b in m.content if b.type == "text")
    assert text == (c["choices"][0]["message"]["content"] or "")
    failed = json.loads(json.dumps(turns))
    failed[2]["content"][0]["is_error"] = True  # told to the model: the prompt grows by the error marker
    n_ok = client.messages.count_tokens(model=model, messages=turns, tools=TOOLS).input_tokens
    n_failed = client.messages.count_tokens(model=model, messages=failed, tools=TOOLS).input_tokens
    assert n_failed > n_ok == prompt_tokens(m.usage)


def test_image_block_equals_the_chat_path(client, server, model):
    data = base64.b64encode(png()).decode()
    content = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
               {"type": "text", "text": "What is this?"}]
    m = client.messages.create(model=model, max_tokens=8, messages=[{"role": "user", "content": content}],
                               extra_body=GREEDY)
    c = chat(server, model, [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
        {"type": "text", "text": "What is this?"}]}], max_tokens=8)
    assert m.content[0].text == c["choices"][0]["message"]["content"]
    assert prompt_tokens(m.usage) == c["usage"]["prompt_tokens"]
    counted = client.messages.count_tokens(model=model, messages=[{"role": "user", "content": content}])
    assert counted.input_tokens == prompt_tokens(m.usage)
    text_only = client.messages.count_tokens(model=model, messages=[{"role": "user", "content": "What is this?"}])
    assert counted.input_tokens > text_only.input_tokens + 4  # the image's vision tokens


def test_count_tokens_equals_the_prompt_of_the_generation(client, model):
    for kw in [dict(messages=USER), dict(messages=USER, system="Be brief.", tools=TOOLS),
               dict(messages=USER, thinking={"type": "enabled", "budget_tokens": 4})]:
        counted = client.messages.count_tokens(model=model, **kw).input_tokens
        m = client.messages.create(model=model, max_tokens=5, extra_body=GREEDY, **kw)
        assert counted == prompt_tokens(m.usage), kw
    with_thinking = client.messages.count_tokens(model=model, messages=USER,
                                                 thinking={"type": "enabled", "budget_tokens": 4}).input_tokens
    assert with_thinking != client.messages.count_tokens(model=model, messages=USER,
                                                         thinking={"type": "disabled"}).input_tokens


def test_thinking_blocks(client, server, model):
    kw = dict(model=model, max_tokens=10, messages=USER, extra_body=GREEDY)
    on = client.messages.create(thinking={"type": "enabled", "budget_tokens": 5}, **kw)
    assert on.content[0].type == "thinking" and on.content[0].thinking and on.content[0].signature
    c = chat(server, model, USER, max_tokens=10, chat_template_kwargs={"enable_thinking": True})
    assert on.content[0].thinking == c["choices"][0]["message"]["reasoning"]
    off = client.messages.create(thinking={"type": "disabled"}, **kw)
    assert all(b.type != "thinking" for b in off.content)
    assert off.content[0].text == chat(server, model, USER, max_tokens=10)["choices"][0]["message"]["content"]
    with client.messages.stream(thinking={"type": "enabled", "budget_tokens": 5}, **kw) as s:
        kinds = [e.type for e in s]
        streamed = s.get_final_message()
    assert "thinking" in kinds and "signature" in kinds
    assert without_id(streamed) == without_id(on)
    events = raw_events(server, {"model": model, "max_tokens": 10, "messages": USER, "temperature": 0,
                                 "thinking": {"type": "enabled", "budget_tokens": 5}})
    block = next(d["content_block"] for n, d in events if n == "content_block_start")
    assert block["type"] == "thinking"
    deltas = [d["delta"]["type"] for n, d in events if n == "content_block_delta"]
    assert deltas[0] == "thinking_delta" and "signature_delta" in deltas


def test_output_config_format_and_chat_template_kwargs(client, server, model):
    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 8}}, "required": ["colour"],
              "additionalProperties": False}
    m = client.messages.create(model=model, max_tokens=60, messages=USER, extra_body=GREEDY,
                               output_config={"format": {"type": "json_schema", "schema": schema}})
    assert m.stop_reason == "end_turn" and [b.type for b in m.content] == ["text"]
    jsonschema.validate(json.loads(m.content[0].text), schema)
    c = chat(server, model, USER, max_tokens=60, response_format={"type": "json_schema", "json_schema": {
        "name": "output", "schema": schema}})
    assert m.content[0].text == c["choices"][0]["message"]["content"]
    kwargs = client.messages.create(model=model, max_tokens=6, messages=USER,
                                    extra_body=dict(GREEDY, chat_template_kwargs={"enable_thinking": True}))
    assert kwargs.content[0].type == "thinking"
    post = lambda body: httpx.post(server.url + "/v1/messages", timeout=60,  # noqa: E731
                                   json=dict({"model": model, "max_tokens": 4, "messages": USER}, **body))
    assert "contradicts" in error_of(post({"thinking": {"type": "disabled"},
                                           "chat_template_kwargs": {"enable_thinking": True}}), 400,
                                     "invalid_request_error")
    assert "effort" in error_of(post({"output_config": {"effort": "low"}}), 400, "invalid_request_error")
    thinking_format = {"thinking": {"type": "enabled", "budget_tokens": 2},
                       "output_config": {"format": {"type": "json_schema", "schema": schema}}}
    assert "output_config.format" in error_of(post(thinking_format), 400, "invalid_request_error")
    bad_schema = {"output_config": {"format": {"type": "json_schema",
                                               "schema": {"type": "object", "minProperties": "x"}}}}
    assert "output_config.format" in error_of(post(bad_schema), 400, "invalid_request_error")


def test_stop_sequences(client, model):
    full = client.messages.create(model=model, max_tokens=12, messages=USER, extra_body=GREEDY).content[0].text
    stop = next(full[i:i + 2] for i in range(2, len(full) - 1)
                if full[i:i + 2].strip() and full[i:i + 2] not in full[:i])  # first seen at i
    m = client.messages.create(model=model, max_tokens=12, messages=USER, stop_sequences=[stop], extra_body=GREEDY)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == full[:full.index(stop)]


def error_of(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind and set(body) == {"type", "error"}
    return body["error"]["message"]


def test_errors_have_anthropics_shape(client, server, model):
    post = lambda body, path="/v1/messages": httpx.post(server.url + path, json=body, timeout=60)  # noqa: E731
    base = {"model": model, "max_tokens": 4, "messages": USER}
    assert "max_tokens" in error_of(post({"model": model, "messages": USER}), 400, "invalid_request_error")
    assert "frequency_penalty" in error_of(post(dict(base, frequency_penalty=0.5)), 400, "invalid_request_error")
    assert "service_tier" in error_of(post(dict(base, service_tier="auto")), 400, "invalid_request_error")
    assert "temperature" in error_of(post(dict(base, temperature=1.5)), 400, "invalid_request_error")
    empty = [USER[0], {"role": "assistant", "content": []}, USER[0]]
    assert "messages[1].content" in error_of(post(dict(base, messages=empty)), 400, "invalid_request_error")
    redacted = [USER[0], {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "xx"}]}, USER[0]]
    assert "redacted_thinking" in error_of(post(dict(base, messages=redacted)), 400, "invalid_request_error")
    assert "budget_tokens" in error_of(post(dict(base, thinking={"type": "enabled", "budget_tokens": 4})), 400,
                                       "invalid_request_error")
    assert "get_time" in error_of(post(dict(base, tools=TOOLS, tool_choice={"type": "tool", "name": "get_time"})),
                                  400, "invalid_request_error")
    error_of(post(dict(base, model="claude-nope")), 404, "not_found_error")
    error_of(post({"model": model, "messages": USER, "foo": 1}, "/v1/messages/count_tokens"), 400,
             "invalid_request_error")
    error_of(httpx.get(server.url + "/v1/messages", timeout=30), 405, "invalid_request_error")
    too_long = error_of(post(dict(base, max_tokens=5000)), 400, "invalid_request_error")
    assert "max_tokens" in too_long or "context" in too_long
    not_png = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(b"not a png").decode()}
    bad = [{"role": "user", "content": [{"type": "image", "source": not_png}]}]
    assert "messages[0].content[0]" in error_of(post(dict(base, system="S", messages=bad)), 400,
                                                "invalid_request_error")  # the request's block, not the chat's
    in_result = [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "text", "text": "x"}, bad[0]["content"][0]]}]}]
    assert "messages[0].content[0].content[1]" in error_of(post(dict(base, messages=in_result)), 400,
                                                           "invalid_request_error")
    inside = [{"role": "user", "content": [{"type": "image", "source": {"type": "url",
                                                                       "url": server.url + "/metrics"}}]}]
    error_of(post(dict(base, messages=inside)), 400, "invalid_request_error")  # the SSRF check: a loopback URL
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.create(model=model, max_tokens=4, messages=USER, extra_body={"logit_bias": {"1": 1}})
    assert exc.value.body["error"]["type"] == "invalid_request_error" and "logit_bias" in str(exc.value)
    assert httpx.get(server.url + "/health").status_code == 200


class PNGHandler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):  # noqa: N802
        body = png()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_api_key_as_x_api_key_or_bearer_the_thinking_lever_and_url_images(tiny_model):
    """One server with an API key, thinking on by default and loopback media allowed."""
    host = ThreadingHTTPServer(("127.0.0.1", 0), PNGHandler)
    threading.Thread(target=host.serve_forever, daemon=True).start()
    running, stop = start_server(tiny_model, api_key=KEY, enable_thinking=True, media_allowed_networks="127.0.0.0/8")
    try:
        keyed = anthropic.Anthropic(base_url=running.url, api_key=KEY, max_retries=0, timeout=120)
        name = keyed.models.list().data[0].id
        by_url = {"type": "url", "url": f"http://127.0.0.1:{host.server_port}/img.png"}
        by_data = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png()).decode()}
        answers = [keyed.messages.create(model=name, max_tokens=4, extra_body=GREEDY, thinking={"type": "disabled"},
                                         messages=[{"role": "user", "content": [{"type": "image", "source": src}]}])
                   for src in (by_url, by_data)]
        assert answers[0].content == answers[1].content
        assert prompt_tokens(answers[0].usage) == prompt_tokens(answers[1].usage)  # the cache may serve the second
        name = httpx.get(running.v1 + "/models", headers={"x-api-key": KEY}).json()["data"][0]["id"]
        for c in [anthropic.Anthropic(base_url=running.url, api_key=KEY, max_retries=0),
                  anthropic.Anthropic(base_url=running.url, auth_token=KEY, max_retries=0)]:
            assert c.messages.count_tokens(model=name, messages=USER).input_tokens > 0
            assert c.messages.create(model=name, max_tokens=2, messages=USER).usage.output_tokens >= 1
        wrong = anthropic.Anthropic(base_url=running.url, api_key="wrong", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as exc:
            wrong.messages.create(model=name, max_tokens=2, messages=USER)
        assert exc.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                             "message": exc.value.body["error"]["message"]}}
        assert httpx.post(running.v1 + "/messages", json={}).status_code == 401
        twice = httpx.post(running.v1 + "/messages", json={}, headers=[("x-api-key", KEY), ("x-api-key", "other")])
        assert "more than one x-api-key" in error_of(twice, 400, "invalid_request_error")
        default = keyed.messages.create(model=name, max_tokens=6, messages=USER, extra_body=GREEDY)
        assert default.content[0].type == "thinking"  # no `thinking` field: the server's lever decides
        off = keyed.messages.create(model=name, max_tokens=6, messages=USER, thinking={"type": "disabled"},
                                    extra_body=GREEDY)
        assert all(b.type != "thinking" for b in off.content)
    finally:
        stop()
        host.shutdown()
        host.server_close()


def test_the_documented_curl(server, model):
    doc = (Path(__file__).resolve().parents[2] / "docs" / "QUICKSTART_SERVER.md").read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", doc, re.S) if "/v1/messages" in b)
    argv = shlex.split(block.replace("\\\n", " "))
    headers = dict(h.split(": ", 1) for h in (argv[i + 1] for i, a in enumerate(argv) if a == "-H"))
    assert "x-api-key" in headers
    body = dict(json.loads(argv[argv.index("-d") + 1]), model=model)
    r = httpx.post(server.url + urlsplit(next(a for a in argv if a.startswith("http://"))).path, json=body,
                   timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["type"] == "message" and r.json()["usage"]["output_tokens"] <= body["max_tokens"]


def test_listed_in_the_openapi_document(server):
    paths = httpx.get(server.url + "/openapi.json", timeout=30).json()["paths"]
    assert "post" in paths["/v1/messages"] and "post" in paths["/v1/messages/count_tokens"]
