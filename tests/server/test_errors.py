"""Bad requests: each gets the right 4xx with vLLM's error JSON (never a 422 or a 500), and the
server keeps serving; mutated request bodies never produce a 5xx."""

from __future__ import annotations

import json
import random

import httpx
import pytest

MSG = [{"role": "user", "content": "hi"}]
CHAT, COMP, RESP = "/v1/chat/completions", "/v1/completions", "/v1/responses"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}


def chat(**kw):
    return dict({"messages": MSG, "max_tokens": 4}, **kw)


# (id, path, body (dict, or raw bytes), status, param or None, message fragment)
BAD = [
    ("malformed_json", CHAT, b'{"messages": [', 400, None, "not valid JSON"),
    ("json_array_body", CHAT, b"[1, 2]", 400, None, "must be a JSON object"),
    ("nan_literal", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400, None,
     "NaN and Infinity are not JSON numbers"),
    ("missing_messages", CHAT, {"max_tokens": 4}, 400, "messages", "Field required"),
    ("empty_messages", CHAT, {"messages": []}, 400, "messages", "at least 1"),
    ("messages_not_list", CHAT, {"messages": "hi"}, 400, "messages", ""),
    ("bad_role", CHAT, {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role", ""),
    ("content_wrong_type", CHAT, {"messages": [{"role": "user", "content": 123}]}, 400, "messages[0].content", ""),
    ("user_content_missing", CHAT, {"messages": [{"role": "user"}]}, 400, "messages[0].content", "required"),
    ("temperature_negative", CHAT, chat(temperature=-1), 400, "temperature", "temperature must be non-negative"),
    ("temperature_string", CHAT, chat(temperature="hot"), 400, "temperature", "valid number"),
    ("top_p_zero", CHAT, chat(top_p=0), 400, "top_p", ""),
    ("top_p_above_one", CHAT, chat(top_p=1.5), 400, "top_p", ""),
    ("top_k_below_minus_one", CHAT, chat(top_k=-2), 400, "top_k", ""),
    ("top_k_beyond_int32", CHAT, chat(top_k=2**63 + 5), 400, "top_k", ""),
    ("stop_token_id_negative", COMP, {"prompt": "x", "stop_token_ids": [-5]}, 400, "stop_token_ids", "non-negative"),
    ("min_p_above_one", CHAT, chat(min_p=2), 400, "min_p", ""),
    ("presence_penalty_range", CHAT, chat(presence_penalty=3), 400, "presence_penalty", ""),
    ("repetition_penalty_zero", CHAT, chat(repetition_penalty=0), 400, "repetition_penalty", ""),
    ("max_tokens_zero", CHAT, chat(max_tokens=0), 400, "max_tokens", ""),
    ("max_tokens_over_context", CHAT, chat(max_tokens=5000), 400, "max_tokens", "maximum context length is 1024"),
    ("n_zero", CHAT, chat(n=0), 400, "n", ""),
    ("empty_stop_string", CHAT, chat(stop=[""]), 400, "stop", "empty string"),
    ("stop_token_ids_strings", CHAT, chat(stop_token_ids=["a"]), 400, "stop_token_ids[0]", ""),
    ("seed_out_of_int64", CHAT, chat(seed=2**70), 400, "seed", ""),
    ("seed_plus_n_overflows", COMP, {"prompt": "x", "max_tokens": 2, "n": 2, "seed": 2**63 - 1}, 400, None,
     "seed + n - 1 must be at most"),
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
    ("image_part_not_a_url", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "x"}}]}]}, 400, "messages[0].content[0]", "not an http(s) URL, a data URL or base64 data"),
    ("image_part_without_url", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content[0].image_url", "must be a URL string"),
    ("image_pil_part", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_pil"}]}]}, 400,
     "messages[0].content[0]", "send an 'image_url' part"),
    ("unknown_part_type", CHAT, {"messages": [{"role": "user", "content": [{"type": "hologram"}]}]}, 400,
     "messages[0].content[0].type", "unknown content part type"),
    ("unknown_model", CHAT, chat(model="gpt-4"), 404, "model", "The model `gpt-4` does not exist."),
    ("prompt_too_long", CHAT, {"messages": [{"role": "user", "content": "word " * 3000}], "max_tokens": 4}, 400,
     "messages", "maximum context length is 1024 tokens. However, your prompt contains"),
    ("bad_words_not_a_list", CHAT, chat(bad_words="x"), 400, "bad_words", "valid list"),
    ("bad_words_empty_word", CHAT, chat(bad_words=["x", ""]), 400, "bad_words", "not empty or blank"),
    ("bad_words_too_many", COMP, {"prompt": "x", "bad_words": [f"w{i}" for i in range(129)]}, 400, "bad_words",
     "at most 128"),
    ("tool_choice_with_response_format", CHAT, chat(tools=[WEATHER], tool_choice="required",
                                                    response_format={"type": "json_object"}), 400, "response_format",
     "cannot be combined with tool_choice"),
    ("json_schema_without_schema", CHAT, chat(response_format={"type": "json_schema", "json_schema": {}}), 400, None,
     "must be an object with `name` and `schema`"),
    ("reserved_template_kwarg", CHAT, chat(chat_template_kwargs={"tokenize": True}), 400, "chat_template_kwargs", ""),
    ("continue_and_generation_prompt", CHAT, chat(continue_final_message=True), 400, None, "Cannot set both"),
    ("request_chat_template", CHAT, chat(chat_template="{{ raise_exception('no such thing') }}"), 400, "chat_template",
     "untrusted chat template"),
    ("continue_without_assistant_last", CHAT, chat(continue_final_message=True, add_generation_prompt=False), 400,
     "messages", "last message to be an assistant message"),
    ("completion_prompt_missing", COMP, {"max_tokens": 4}, 400, "prompt", "Field required"),
    ("completion_prompt_empty_list", COMP, {"prompt": []}, 400, None, "empty list"),
    ("completion_prompt_empty_string", COMP, {"prompt": ""}, 400, "prompt", "empty"),
    ("completion_token_out_of_vocab", COMP, {"prompt": [1, 999999]}, 400, "prompt", "outside the vocabulary"),
    ("completion_prompt_object", COMP, {"prompt": {"a": 1}}, 400, "prompt", ""),
    ("completion_logprobs_over_max", COMP, {"prompt": "x", "logprobs": 21}, 400, "logprobs", "max allowed: 20"),
    ("completion_suffix", COMP, {"prompt": "x", "suffix": "y"}, 400, None, "suffix is not supported"),
    ("completion_unknown_model", COMP, {"prompt": "x", "model": "nope"}, 404, "model", "does not exist"),
    ("responses_input_missing", RESP, {"max_output_tokens": 4}, 400, "input", "Field required"),
    ("responses_previous_id_unknown", RESP, {"input": "x", "previous_response_id": "resp_1"}, 404,
     "previous_response_id", "Response with id 'resp_1' not found."),
    ("responses_background_stream", RESP, {"input": "x", "background": True, "stream": True}, 400, None,
     "does not stream background responses"),
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


VALID = [
    (CHAT, {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                         {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                             "name": "get_weather", "arguments": "{}"}}]}, {"role": "tool", "tool_call_id": "c1", "content": "ok"}],
            "max_tokens": 2, "temperature": 0, "tools": [WEATHER], "tool_choice": "auto", "stop": ["x"], "n": 1,
            "top_p": 0.9, "top_k": 5, "logprobs": True, "top_logprobs": 1, "seed": 1,
            "chat_template_kwargs": {"enable_thinking": True}, "stream": False}),
    (COMP, {"prompt": "hi", "max_tokens": 2, "n": 1, "logprobs": 1, "echo": False, "seed": 3, "stop_token_ids": [5],
            "min_tokens": 1, "presence_penalty": 0.5}),
    (RESP, {"input": [{"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c", "name": "f",
                                                         "arguments": "{}"}],
            "max_output_tokens": 2, "tools": [{"type": "function", "name": "f"}], "instructions": "be brief"}),
]
WEIRD = [None, True, -1, 0, 2**64, 1e308, -0.5, "", "x", "\u0000<think>", [], [None], [1, "a"], {}, {"a": None}, [[1]]]
KEEP = {"max_tokens", "max_output_tokens"}  # bounded output keeps the fuzz fast


def _mutate(body, rng: random.Random):
    """Replace, delete or add one field somewhere in the body."""
    node = body
    while True:
        keys = [k for k in (node if isinstance(node, dict) else range(len(node))) if k not in KEEP]
        if not keys:
            return
        key = rng.choice(keys)
        child = node[key]
        if isinstance(child, (dict, list)) and child and rng.random() < 0.6:
            node = child
            continue
        roll = rng.random()
        if roll < 0.15 and isinstance(node, dict):
            del node[key]
        elif roll < 0.25 and isinstance(node, dict):
            node["unexpected_" + str(rng.randint(0, 9))] = rng.choice(WEIRD)
        else:
            node[key] = rng.choice(WEIRD)
        return


def test_mutated_bodies_never_give_5xx(server):
    rng = random.Random(20261130)
    seen = {}
    with server.client() as c:
        for i in range(150):
            path, valid = VALID[i % len(VALID)]
            body = json.loads(json.dumps(valid))
            for _ in range(rng.randint(1, 3)):
                _mutate(body, rng)
            r = c.post(path, json=body)
            assert r.status_code < 500, (body, r.text)
            seen[r.status_code] = seen.get(r.status_code, 0) + 1
            if r.status_code != 200:
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
    print(seen)
    assert seen.get(400, 0) > 30 and seen.get(200, 0) > 10, seen  # both kinds were exercised


def test_server_still_serves_after_bad_requests(server):
    """Runs after the table (file order): a normal request succeeds and nothing is left running."""
    with server.client() as c:
        r = c.post(CHAT, json=chat(temperature=0))
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
        assert c.get("/health").status_code == 200
    assert server.metric("vllm:num_requests_running") == 0
