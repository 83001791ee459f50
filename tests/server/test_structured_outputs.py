"""Structured outputs through the official openai client on the embedded random-weight model (whose
unconstrained output is never valid JSON): response_format json_schema / json_object in chat and
completions, Responses' text.format, vLLM's structured_outputs and guided_* fields, streamed and
not; every output parses and validates, and finishes with "stop". Bad specs are 400s."""

from __future__ import annotations

import json
import random
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

S = {"type": "string", "maxLength": 4}
I = {"type": "integer", "minimum": -20, "maximum": 300}


def obj(props: dict, required=None) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False}


SCHEMAS = [
    obj({"a": I}),
    obj({"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    obj({"flag": {"type": "boolean"}, "nothing": {"type": "null"}}),
    obj({"color": {"enum": ["red", "green", "blue"]}}),
    obj({"v": {"enum": [1, 2.5, "x", None, True]}}),
    obj({"inner": obj({"deeper": obj({"x": I})})}),
    obj({"xs": {"type": "array", "items": I, "maxItems": 3}}),
    obj({"xs": {"type": "array", "items": obj({"k": S}), "minItems": 1, "maxItems": 2}}),
    obj({"t": {"type": "number", "minimum": 0, "maximum": 1}}),
    obj({"t": {"type": "number", "exclusiveMinimum": -5, "exclusiveMaximum": 5}}),
    obj({"u": {"anyOf": [I, {"type": "boolean"}, {"enum": ["n/a"]}]}}),
    obj({"u": {"anyOf": [obj({"a": I}), obj({"b": S})]}}),
    obj({"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}}),
    obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])$"}}),
    obj({"opt": I, "req": {"type": "boolean"}}, required=["req"]),
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 4},
    {"type": "array", "prefixItems": [I, S], "items": False},
    {"enum": ["alpha", "beta"]},
    obj({"id": {"type": "integer", "minimum": 1000, "maximum": 1003}, "tags": {"type": "array", "items": S,
                                                                             "maxItems": 2}}),
    obj({"m": {"type": "array", "items": {"type": "array", "items": {"enum": [0, 1]}, "maxItems": 2},
               "maxItems": 2}}),
]
assert len(SCHEMAS) == 20


def _chat(client, fmt_or_extra: dict, stream: bool, seed: int, max_tokens: int = 200):
    kw = {"response_format": fmt_or_extra} if "type" in fmt_or_extra else {"extra_body": fmt_or_extra}
    args = dict(model="tiny-0-0", messages=[{"role": "user", "content": f"give json {seed}"}], max_tokens=max_tokens,
                seed=seed, temperature=1.0, **kw)
    if not stream:
        c = client.chat.completions.create(**args).choices[0]
        return c.message.content, c.finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **args):
        for ch in chunk.choices:
            text += ch.delta.content or ""
            finish = ch.finish_reason or finish
    return text, finish


def _json_schema(schema, i):
    return {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}


@pytest.mark.parametrize("stream", [False, True])
def test_twenty_schemas_validate(openai_client, stream):
    seed0 = random.randrange(1 << 30)
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda i: _chat(openai_client, _json_schema(SCHEMAS[i], i), stream, seed0 + i),
                             range(len(SCHEMAS))))
    for i, (text, finish) in enumerate(outs):
        assert finish == "stop", (i, text)
        jsonschema.validate(json.loads(text), SCHEMAS[i])


def test_json_object_and_vllm_fields(openai_client):
    seed = random.randrange(1 << 30)
    for k in range(3):
        text, finish = _chat(openai_client, {"type": "json_object"}, bool(k % 2), seed + k, max_tokens=400)
        if finish == "length":  # a free JSON object may be cut by max_tokens: then a prefix of one
            assert text.startswith("{")
        else:
            assert finish == "stop" and isinstance(json.loads(text), dict), text
    schema = SCHEMAS[7]
    for extra in ({"structured_outputs": {"json": schema}}, {"guided_json": schema},
                  {"structured_outputs": {"json": json.dumps(schema)}}):
        text, finish = _chat(openai_client, extra, True, seed)
        assert finish == "stop"
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("stream", [False, True])
def test_regex_choice_grammar(openai_client, stream):
    seed = random.randrange(1 << 30)
    rx = r"[a-z]{3,6}@[a-z]{2,4}\.(com|org)"
    choices = ["left", "right", "up \"quoted\""]
    cases = [({"structured_outputs": {"regex": rx}}, lambda t: re.fullmatch(rx, t)),
             ({"guided_regex": rx}, lambda t: re.fullmatch(rx, t)),
             ({"structured_outputs": {"choice": choices}}, lambda t: t in choices),
             ({"guided_choice": choices}, lambda t: t in choices),
             ({"structured_outputs": {"grammar": 'root ::= ("ab" | "cd") [0-9]{1,3}'}},
              lambda t: re.fullmatch(r"(ab|cd)[0-9]{1,3}", t)),
             ({"guided_grammar": 'root ::= "x" "y"*  "z"'}, lambda t: re.fullmatch(r"xy*z", t) or None)]
    for extra, ok in cases:
        for k in range(3):
            text, finish = _chat(openai_client, extra, stream, seed + k, max_tokens=120)
            if "y*" in str(extra) and finish == "length":  # the one unbounded grammar: a valid prefix
                assert re.fullmatch(r"xy*", text)
                continue
            assert finish == "stop" and ok(text), (extra, text, finish)


def test_completions_and_responses(openai_client):
    seed = random.randrange(1 << 30)
    schema = SCHEMAS[1]
    c = openai_client.completions.create(model="tiny-0-0", prompt="json:", max_tokens=200, seed=seed, n=3,
                                         extra_body={"response_format": _json_schema(schema, 1)})
    for ch in c.choices:
        assert ch.finish_reason == "stop"
        jsonschema.validate(json.loads(ch.text), schema)
    text = "".join(ch.choices[0].text for ch in openai_client.completions.create(
        model="tiny-0-0", prompt="pick", max_tokens=50, seed=seed, stream=True,
        extra_body={"structured_outputs": {"choice": ["one", "two"]}}) if ch.choices)
    assert text in ("one", "two")
    r = openai_client.responses.create(model="tiny-0-0", input="json please", max_output_tokens=200, temperature=1.0,
                                       text={"format": {"type": "json_schema", "name": "p", "schema": schema,
                                                        "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)


def test_bad_constraints_are_400(openai_client):
    bad = [{"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
           {"response_format": {"type": "json_schema"}},
           {"response_format": {"type": "yaml"}},
           {"structured_outputs": {"regex": "(unclosed"}},
           {"structured_outputs": {"grammar": "root ::= missing_rule"}},
           {"structured_outputs": {"choice": []}},
           {"structured_outputs": {"regex": "a", "choice": ["b"]}},
           {"structured_outputs": {"structural_tag": "{}"}},
           {"guided_json": {"type": "object"}, "guided_regex": "a+"},
           {"guided_json": 5},
           {"guided_regex": "a+", "chat_template_kwargs": {"enable_thinking": True}}]  # would constrain the thinking
    for body in bad:
        with pytest.raises(openai.BadRequestError) as ei:
            openai_client.chat.completions.create(model="tiny-0-0", messages=[{"role": "user", "content": "x"}],
                                                  max_tokens=5, extra_body=body)
        assert ei.value.status_code == 400 and ei.value.body["message"], body
    with pytest.raises(openai.BadRequestError):
        openai_client.responses.create(model="tiny-0-0", input="x", text={"format": {"type": "json_schema", "name": "p",
                                                                                 "schema": {"type": "nope"}}})
