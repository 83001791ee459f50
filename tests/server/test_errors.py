"""Bad requests: each gets the right 4xx with vLLM's error JSON (never a 422 or a 500), and the
server keeps serving. Plus auth (401), body limit (413) and queue bound (503 + Retry-After) on a
second server with those levers set."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from conftest import start_server

MSG = [{"role": "user", "content": "hi"}]
CHAT, COMP, RESP = "/v1/chat/completions", "/v1/completions", "/v1/responses"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}


def chat(**kw):
    return dict({"messages": MSG, "max_tokens": 4}, **kw)


# (id, path, body (dict, or raw bytes), status, param or None, message fragment)
BAD = [
    ("malformed_json", CHAT, b'{"messages": [', 400, None, "not valid JSON"),
    ("json_array_body", CHAT, b"[1, 2]", 400, None, "must be a JSON object"),
    ("nan_literal", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400, "temperature", ""),
    ("missing_messages", CHAT, {"max_tokens": 4}, 400, "messages", "Field required"),
    ("empty_messages", CHAT, {"messages": []}, 400, "messages", "at least 1"),
    ("messages_not_list", CHAT, {"messages": "hi"}, 400, "messages", ""),
    ("bad_role", CHAT, {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role", ""),
    ("content_wrong_type", CHAT, {"messages": [{"role": "user", "content": 123}]}, 400, "messages[0].content", ""),
    ("user_content_missing", CHAT, {"messages": [{"role": "user"}]}, 400, "messages[0].content", "required"),
    ("temperature_negative", CHAT, chat(temperature=-1), 400, "temperature", "greater than or equal to 0"),
    ("temperature_string", CHAT, chat(temperature="hot"), 400, "temperature", "valid number"),
    ("top_p_zero", CHAT, chat(top_p=0), 400, "top_p", ""),
    ("top_p_above_one", CHAT, chat(top_p=1.5), 400, "top_p", ""),
    ("top_k_below_minus_one", CHAT, chat(top_k=-2), 400, "top_k", ""),
    ("min_p_above_one", CHAT, chat(min_p=2), 400, "min_p", ""),
    ("presence_penalty_range", CHAT, chat(presence_penalty=3), 400, "presence_penalty", ""),
    ("repetition_penalty_zero", CHAT, chat(repetition_penalty=0), 400, "repetition_penalty", ""),
    ("max_tokens_zero", CHAT, chat(max_tokens=0), 400, "max_tokens", ""),
    ("max_tokens_over_context", CHAT, chat(max_tokens=5000), 400, "max_tokens", "maximum context length is 1024"),
    ("n_zero", CHAT, chat(n=0), 400, "n", ""),
    ("empty_stop_string", CHAT, chat(stop=[""]), 400, "stop", "empty string"),
    ("stop_token_ids_strings", CHAT, chat(stop_token_ids=["a"]), 400, "stop_token_ids[0]", ""),
    ("seed_out_of_int64", CHAT, chat(seed=2**70), 400, "seed", ""),
    ("stream_options_without_stream", CHAT, chat(stream_options={"include_usage": True}), 400, None,
     "Stream options can only be defined when `stream=True`."),
    ("top_logprobs_without_logprobs", CHAT, chat(top_logprobs=2), 400, None, "`logprobs` must be set"),
    ("top_logprobs_over_max", CHAT, chat(logprobs=True, top_logprobs=50), 400, "top_logprobs",
     "greater than max allowed: 20"),
    ("tool_choice_without_tools", CHAT, chat(tool_choice="auto"), 400, None, "`tools` must be set"),
    ("named_tool_not_in_tools", CHAT, chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "x"}}),
     400, None, "not among the tools"),
    ("tool_parameters_not_object", CHAT, chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "string"}}}]), 400, "tools[0].function.parameters", "type 'object'"),
    ("tool_properties_not_object", CHAT, chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": ["a"]}}}]), 400, "tools[0].function.parameters", ""),
    ("tool_name_with_spaces", CHAT, chat(tools=[{"type": "function", "function": {"name": "get weather"}}]), 400,
     "tools[0].function.name", "function name"),
    ("tools_not_list", CHAT, chat(tools={"name": "f"}), 400, "tools", ""),
    ("tool_call_arguments_not_json", CHAT, {"messages": MSG + [{"role": "assistant", "tool_calls": [{
        "id": "c", "type": "function", "function": {"name": "f", "arguments": "{city: Paris"}}]}], "max_tokens": 4},
     400, "messages[1].tool_calls[0].function.arguments", "not valid JSON"),
    ("image_part", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages[0].content[0]", "images are not supported yet"),
    ("unknown_part_type", CHAT, {"messages": [{"role": "user", "content": [{"type": "hologram"}]}]}, 400,
     "messages[0].content[0].type", "unknown content part type"),
    ("unknown_model", CHAT, chat(model="gpt-4"), 404, "model", "The model `gpt-4` does not exist."),
    ("prompt_too_long", CHAT, {"messages": [{"role": "user", "content": "word " * 3000}], "max_tokens": 4}, 400,
     "messages", "maximum context length is 1024 tokens. However, your prompt contains"),
    ("logit_bias_unsupported", CHAT, chat(logit_bias={"5": 1.0}), 400, None, "not supported"),
    ("json_schema_unsupported", CHAT, chat(response_format={"type": "json_schema", "json_schema": {}}), 400, None,
     "not supported"),
    ("reserved_template_kwarg", CHAT, chat(chat_template_kwargs={"tokenize": True}), 400, "chat_template_kwargs", ""),
    ("continue_and_generation_prompt", CHAT, chat(continue_final_message=True), 400, None, "Cannot set both"),
    ("template_raises", CHAT, chat(chat_template="{{ raise_exception('no such thing') }}"), 400, "messages",
     "no such thing"),
    ("completion_prompt_missing", COMP, {"max_tokens": 4}, 400, "prompt", "Field required"),
    ("completion_prompt_empty_list", COMP, {"prompt": []}, 400, None, "empty list"),
    ("completion_prompt_empty_string", COMP, {"prompt": ""}, 400, "prompt", "empty"),
    ("completion_token_out_of_vocab", COMP, {"prompt": [1, 999999]}, 400, "prompt", "outside the vocabulary"),
    ("completion_prompt_object", COMP, {"prompt": {"a": 1}}, 400, "prompt", ""),
    ("completion_logprobs_over_max", COMP, {"prompt": "x", "logprobs": 21}, 400, "logprobs", "max allowed: 20"),
    ("completion_suffix", COMP, {"prompt": "x", "suffix": "y"}, 400, None, "suffix is not supported"),
    ("completion_unknown_model", COMP, {"prompt": "x", "model": "nope"}, 404, "model", "does not exist"),
    ("responses_input_missing", RESP, {"max_output_tokens": 4}, 400, "input", "Field required"),
    ("responses_previous_id", RESP, {"input": "x", "previous_response_id": "resp_1"}, 400, None, "not supported"),
    ("responses_builtin_tool", RESP, {"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools[0]", "function tools"),
    ("responses_bad_item", RESP, {"input": [{"type": "telepathy"}]}, 400, "input[0].type", "unsupported item type"),
    ("detokenize_out_of_vocab", "/detokenize", {"tokens": [-1]}, 400, "tokens", "outside the vocabulary"),
    ("tokenize_both_inputs", "/tokenize", {"prompt": "x", "messages": MSG}, 400, None, "exactly one"),
    ("unknown_route", "/v1/embeddings", {"input": "x"}, 404, None, "no route"),
]


@pytest.mark.parametrize("name,path,body,status,param,fragment", BAD, ids=[b[0] for b in BAD])
def test_bad_request(server, name, path, body, status, param, fragment):
    with server.client() as c:
        if isinstance(body, bytes):
            r = c.post(path, content=body, headers={"content-type": "application/json"})
        else:
            r = c.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert err["type"] == {400: "BadRequestError", 404: "NotFoundError"}[status]
    assert fragment in err["message"], err["message"]
    if param is not None:
        assert err["param"] == param, err


def test_bad_request_table_is_large_enough():
    assert len(BAD) >= 25


def test_wrong_content_type_and_method(server):
    r = httpx.post(server.v1 + "/chat/completions", content=json.dumps(chat()), headers={"content-type": "text/plain"})
    assert r.status_code == 400 and "Only 'application/json'" in r.json()["error"]["message"]
    r = httpx.get(server.v1 + "/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == 405


def test_server_still_serves_after_bad_requests(server):
    """Runs after the table (file order): a normal request succeeds and nothing is left running."""
    with server.client() as c:
        r = c.post(CHAT, json=chat(temperature=0))
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
        assert c.get("/health").status_code == 200
    assert server.metric("vllm:num_requests_running") == 0


@pytest.fixture(scope="module")
def guarded(tiny_model):
    running, stop = start_server(tiny_model, api_key="sekret", max_body_bytes=4096, max_waiting=1, max_num_seqs=1)
    yield running
    stop()


def test_api_key(guarded):
    good = {"Authorization": "Bearer sekret"}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
        r = httpx.post(guarded.v1 + "/chat/completions", json=chat(), headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
        assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(guarded.v1 + "/models").status_code == 401
    assert httpx.get(guarded.v1 + "/models", headers=good).status_code == 200
    assert httpx.post(guarded.v1 + "/chat/completions", json=chat(), headers=good).status_code == 200
    for open_path in ("/health", "/metrics", "/version"):  # operations stay open, as in vLLM
        assert httpx.get(guarded.url + open_path).status_code == 200


def test_body_too_large(guarded):
    good = {"Authorization": "Bearer sekret"}
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
    good = {"Authorization": "Bearer sekret"}
    long = chat(max_tokens=400, ignore_eos=True, temperature=0, stream=True)
    aborted_before = guarded.metric("vllm:request_success_total", finished_reason="abort")
    with httpx.Client(headers=good, timeout=60) as c1, httpx.Client(headers=good, timeout=60) as c2:
        with c1.stream("POST", guarded.v1 + "/chat/completions", json=long) as r1, \
                c2.stream("POST", guarded.v1 + "/chat/completions", json=long) as r2:
            assert r1.status_code == r2.status_code == 200
            deadline = time.time() + 60
            while guarded.metric("vllm:num_requests_waiting") < 1:
                assert time.time() < deadline, "the second request never queued"
                time.sleep(0.05)
            r = httpx.post(guarded.v1 + "/chat/completions", json=chat(), headers=good)
            assert r.status_code == 503, r.text
            assert r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "ServiceUnavailableError"
            assert "busy" in r.json()["error"]["message"]
            assert guarded.metric("vllm:admission_rejections_total") == 1
    deadline = time.time() + 30
    while guarded.metric("vllm:num_requests_running") + guarded.metric("vllm:num_requests_waiting") > 0:
        assert time.time() < deadline, "dropped streams were not aborted"
        time.sleep(0.05)
    assert guarded.metric("vllm:request_success_total", finished_reason="abort") == aborted_before + 2
    r = httpx.post(guarded.v1 + "/chat/completions", json=chat(), headers=good)
    assert r.status_code == 200
