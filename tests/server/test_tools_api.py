"""Tool calls and reasoning through the API on the tiny model: how messages with tool calls render,
calls for tool_choice named/required (the call grammar itself: test_tool_calls_constrained.py),
thinking on/off per request, stream == non-stream."""

from __future__ import annotations

import json

import httpx
import pytest

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "days": {"type": "integer"}},
                                                "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def _collect_stream(lines) -> dict:
    """Assemble an SSE chat stream into content, reasoning and tool calls (by index)."""
    out = {"content": "", "reasoning": "", "reasoning_content": "", "calls": {}, "finish": None, "chunks": 0}
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        body = json.loads(line[6:])
        assert "error" not in body, body
        out["chunks"] += 1
        for ch in body["choices"]:
            d = ch["delta"]
            out["content"] += d.get("content") or ""
            out["reasoning"] += d.get("reasoning") or ""
            out["reasoning_content"] += d.get("reasoning_content") or ""
            for tc in d.get("tool_calls") or []:
                call = out["calls"].setdefault(tc["index"], {"name": None, "arguments": ""})
                if "id" in tc:
                    call["name"] = tc["function"]["name"]
                    assert tc["id"].startswith("call_") and tc["type"] == "function"
                call["arguments"] += tc["function"].get("arguments", "")
            out["finish"] = ch["finish_reason"] or out["finish"]
    return out


def _both(server, body) -> tuple[dict, dict]:
    with server.client() as c:
        whole = c.post("/v1/chat/completions", json=body)
        assert whole.status_code == 200, whole.text
        with c.stream("POST", "/v1/chat/completions", json=dict(body, stream=True)) as r:
            assert r.status_code == 200
            streamed = _collect_stream(list(r.iter_lines()))
    return whole.json()["choices"][0], streamed


def test_history_with_tool_calls_renders(server):
    """Assistant tool_calls with JSON-string arguments render as Qwen3.5 XML; tool results as
    <tool_response>; reasoning given as reasoning_content reaches the template."""
    messages = ASK + [
        {"role": "assistant", "content": None, "reasoning_content": "Need the weather tool.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"}]
    with server.client() as c:
        ids = c.post("/tokenize", json={"messages": messages, "tools": [WEATHER]}).json()["tokens"]
        text = c.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert '"name": "get_weather"' in text and "<tools>" in text
    assert ("<think>\nNeed the weather tool.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
            "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call><|im_end|>") in text
    assert "<|im_start|>user\n<tool_response>\n18C, sunny\n</tool_response><|im_end|>" in text


def test_named_tool_choice_forces_the_call(server):
    body = {"messages": ASK, "tools": [WEATHER, TIME], "max_tokens": 64, "temperature": 0,
            "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    whole, streamed = _both(server, body)
    calls = whole["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_time"] and calls[0]["function"]["arguments"] == "{}"
    assert streamed["calls"] == {0: {"name": "get_time", "arguments": "{}"}}
    assert whole["finish_reason"] == streamed["finish"] == "tool_calls"


def test_required_with_one_tool_and_thinking_on(server):
    """required + one tool = that tool; an open think block is closed before the call."""
    body = {"messages": ASK, "tools": [TIME], "tool_choice": "required", "max_tokens": 64, "temperature": 0,
            "parallel_tool_calls": False, "chat_template_kwargs": {"enable_thinking": True}}
    whole, streamed = _both(server, body)
    assert [c["function"]["name"] for c in whole["message"]["tool_calls"]] == ["get_time"]
    assert whole["message"]["reasoning"] is None and whole["finish_reason"] == "tool_calls"
    assert streamed["calls"] == {0: {"name": "get_time", "arguments": "{}"}} and streamed["reasoning"] == ""


def test_tool_choice_none_and_auto_leave_plain_text(server):
    """Random tiny-model text holds no calls: auto and none both answer content only, and the
    tools still reach the template (vLLM's default)."""
    for choice in ("auto", "none"):
        whole, streamed = _both(server, {"messages": ASK, "tools": [WEATHER], "tool_choice": choice,
                                         "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert whole["message"]["tool_calls"] == [] and whole["finish_reason"] == "length"
        assert streamed["content"] == whole["message"]["content"] and streamed["calls"] == {}


@pytest.mark.parametrize("thinking", [True, False])
def test_reasoning_split_through_api(server, thinking):
    """Thinking on: the prompt ends inside <think>, the tiny model never closes it, so all output
    is reasoning (sent as both `reasoning` and `reasoning_content`). Off: all content."""
    body = {"messages": ASK, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
            "chat_template_kwargs": {"enable_thinking": thinking}}
    whole, streamed = _both(server, body)
    msg = whole["message"]
    if thinking:
        assert msg["content"] is None and msg["reasoning"] and msg["reasoning"] == msg["reasoning_content"]
        assert streamed["reasoning"] == streamed["reasoning_content"] == msg["reasoning"]
        assert streamed["content"] == ""
    else:
        assert msg["reasoning"] is None and msg["content"]
        assert streamed["content"] == msg["content"] and streamed["reasoning"] == ""


def test_reasoning_effort_none_turns_thinking_off(server):
    with server.client() as c:
        r = c.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                                                 "reasoning_effort": "none"}).json()
    assert r["choices"][0]["message"]["reasoning"] is None and r["choices"][0]["message"]["content"]


def test_include_reasoning_false_drops_it(server):
    with server.client() as c:
        r = c.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                                                 "include_reasoning": False,
                                                 "chat_template_kwargs": {"enable_thinking": True}}).json()
    msg = r["choices"][0]["message"]
    assert "reasoning" not in msg and msg["content"] is None


def test_responses_function_call_items(openai_client):
    tools = [{"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}]
    r = openai_client.responses.create(
        model="tiny-0-0", max_output_tokens=64, temperature=0, tools=tools,
        tool_choice={"type": "function", "name": "get_time"},
        input=[{"role": "user", "content": "Time?"},
               {"type": "function_call", "call_id": "call_a", "name": "get_time", "arguments": "{}"},
               {"type": "function_call_output", "call_id": "call_a", "output": "12:00"},
               {"role": "user", "content": [{"type": "input_text", "text": "And now?"}]}])
    calls = [o for o in r.output if o.type == "function_call"]
    assert [c.name for c in calls] == ["get_time"] and isinstance(json.loads(calls[0].arguments), dict)
    events = list(openai_client.responses.create(
        model="tiny-0-0", max_output_tokens=64, temperature=0, tools=tools, stream=True,
        tool_choice={"type": "function", "name": "get_time"}, input="Time?"))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].name == "get_time"
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == done[0].arguments and isinstance(json.loads(deltas), dict)


def test_undecodable_image_parts_are_refused_clearly(server):
    body = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}], "max_tokens": 4}
    r = httpx.post(server.v1 + "/chat/completions", json=body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert "could not decode the image" in err["message"] and err["param"] == "messages[0].content[1]"
