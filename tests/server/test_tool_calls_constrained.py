"""Tool calls that cannot be malformed: tool_choice `required` and a named function decode under the
qwen3_coder call grammar (qv/server/parsers/qwen3_coder_grammar.py).

- The grammar alone: random walks over its token masks (any allowed token, uniformly) always end
  in text that qv's own tool parser reads as calls of the given tools whose arguments validate
  with jsonschema; the raw-text values take what the parser keeps and nothing it would cut at.
- Through the official openai client on the embedded random-weight model (whose free output never
  holds a call): 10 seeds x (1, 2, 5 tools), streamed and not, every call is named among the tools
  and its arguments validate; parallel_tool_calls=false gives exactly one call, a named function
  exactly one call of it.
"""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
import torch
from conftest import start_server  # at import: another folder's conftest may hold the name later

S = {"type": "string", "maxLength": 4}
DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}


def fn(name: str, props: dict, required: list | None = None) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": props, "required": list(props) if required is None else required}}}


TOOLS = [
    fn("get_weather", {"city": S, "days": {"type": "integer", "minimum": 1, "maximum": 14}}, ["city"]),
    fn("get_time", {}),
    fn("set_color", {"color": {"enum": ["red", "green", "blue"]}, "alpha": {"type": "number", "minimum": 0,
                                                                             "maximum": 1}}, ["color"]),
    fn("book", {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]$"}, "ok": {"type": "boolean"},
                "where": {"type": "object", "properties": {"x": DIGIT, "tag": S}, "required": ["x"],
                          "additionalProperties": False},
                "ids": {"type": "array", "items": DIGIT, "maxItems": 2}}, ["code", "where"]),
    fn("pick", {"u": {"anyOf": [DIGIT, {"type": "null"}]}, "v": {"anyOf": [S, DIGIT]}, "n": {"type": "null"},
                "who": {"type": ["string", "null"], "maxLength": 2}}),
]
FREE_TEXT = fn("note", {"text": {"type": "string"}, "n": DIGIT})  # an unbounded raw-text value
NAMES = [t["function"]["name"] for t in TOOLS]


def schema_of(name: str) -> dict:
    return next(t["function"]["parameters"] for t in TOOLS + [FREE_TEXT] if t["function"]["name"] == name)


def check_calls(calls: list[tuple[str, str]], allowed: list[str]) -> None:
    """(name, arguments JSON) of each call: a known tool, arguments valid for its schema."""
    assert calls
    for name, arguments in calls:
        assert name in allowed, (name, allowed)
        jsonschema.validate(json.loads(arguments), schema_of(name))


# -- the grammar alone -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def compiler(tiny_model):
    from transformers import AutoTokenizer

    from qv.engine.structured import GrammarCompiler

    tok = AutoTokenizer.from_pretrained(tiny_model)
    vocab = (len(tok) + 63) // 64 * 64
    return tok, GrammarCompiler(tok, vocab, [tok.convert_tokens_to_ids("<|im_end|>")])


def _tag(compiler, tools, forced=None, parallel=True):
    from qv.server.parsers.qwen3_coder_grammar import tool_call_tag

    return compiler[1].compile("structural_tag", json.dumps(tool_call_tag(tools, forced, parallel)), "tools")


def _random_walk(grammar, vocab: int, rng: random.Random, limit: int = 600) -> list[int] | None:
    """Token ids of one output that takes a uniformly random allowed token at every step, or None
    when it runs past `limit` tokens."""
    import xgrammar as xgr

    matcher, mask = grammar.matcher(), xgr.allocate_token_bitmask(1, vocab)
    ids = []
    for _ in range(limit):
        matcher.fill_next_token_bitmask(mask, 0)
        logits = torch.zeros(1, vocab)
        xgr.apply_token_bitmask_inplace(logits, mask)
        token = rng.choice(torch.nonzero(logits[0] == 0).flatten().tolist())
        assert matcher.accept_token(token)
        if matcher.is_terminated():
            return ids
        ids.append(token)
    return None


@pytest.mark.parametrize("tools,forced,parallel", [(TOOLS[:1], None, True), (TOOLS[:2], None, False),
                                                   (TOOLS, None, True), (TOOLS, "book", True)])
def test_every_grammar_output_parses_and_validates(compiler, tools, forced, parallel):
    from qv.server.parsers import Qwen3CoderToolParser

    tok, gc = compiler
    grammar, parser = _tag(compiler, tools, forced, parallel), Qwen3CoderToolParser(tools)
    rng, ended, counts = random.Random(random.randrange(1 << 30)), 0, set()
    for _ in range(30):
        ids = _random_walk(grammar, gc.vocab_size, rng)
        if ids is None:
            continue
        ended += 1
        text = tok.decode(ids)
        got = parser.extract_tool_calls(text)
        assert got.content is None, text
        check_calls([(c.name, c.arguments) for c in got.tool_calls], [forced] if forced else
                    [t["function"]["name"] for t in tools])
        counts.add(len(got.tool_calls))
    assert ended >= 25  # every value here is bounded: walks end
    if forced or not parallel:
        assert counts == {1}


def test_raw_text_values_take_what_the_parser_keeps(compiler):
    """An unbounded string parameter is any text (newlines, '<', non-ASCII, a lone `</parameter`)
    but never a marker the parser would cut the value or the call at."""
    from qv.server.parsers import Qwen3CoderToolParser

    grammar, parser = _tag(compiler, [FREE_TEXT], "note"), Qwen3CoderToolParser([FREE_TEXT])
    head = "<tool_call>\n<function=note>\n<parameter=text>\n"
    for value in ["\nx < y\n\n", "a</paramete", "café ☕", "<tool_call>", "</think>", ""]:
        text = head + value + "\n</parameter>\n<parameter=n>\n7\n</parameter>\n</function>\n</tool_call>"
        m = grammar.matcher()
        assert m.accept_string(text), repr(value)
        call = parser.extract_tool_calls(text).tool_calls[0]
        assert json.loads(call.arguments) == {"text": value, "n": 7}
    for marker in ["</parameter>", "<parameter=", "</function>", "</tool_call>"]:
        m = grammar.matcher()
        assert not m.accept_string(head + "a" + marker + "b\n</parameter>\n"), marker


def test_tools_that_cannot_be_constrained_are_refused(compiler):
    from qv.server.parsers.qwen3_coder_grammar import ToolGrammarError, tool_call_tag

    for props in ({"a>b": S}, {"e": {"enum": [1, 2]}}, {"t": {"type": "widget"}}):
        with pytest.raises(ToolGrammarError):
            tool_call_tag([fn("f", props)], None, True)
    with pytest.raises(ToolGrammarError, match="'g', which is not among the tools \\(f\\)"):
        tool_call_tag([fn("f", {"a": S})], "g", True)
    with pytest.raises(ToolGrammarError, match="at least one tool"):
        tool_call_tag([], None, True)


# -- through the API ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tools_client(tiny_model):
    """A server with room for the five tools' prompt (about 1,700 tiny-tokenizer tokens) and the calls."""
    running, stop = start_server(tiny_model, max_model_len=4096)
    yield openai.OpenAI(base_url=running.v1, api_key="unused", max_retries=0, timeout=300)
    stop()


def _call(client, tools, seed: int, stream: bool, **kw) -> tuple[list[tuple[str, str]], str]:
    args = dict(model="tiny-0-0", messages=[{"role": "user", "content": f"call something {seed}"}], tools=tools,
                seed=seed, temperature=1.0, **kw)  # max_tokens: the room left
    if not stream:
        c = client.chat.completions.create(**args).choices[0]
        return [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []], c.finish_reason
    calls, finish = {}, None
    for chunk in client.chat.completions.create(stream=True, **args):
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or []:
                name, arguments = calls.get(tc.index, (None, ""))
                calls[tc.index] = (tc.function.name or name, arguments + (tc.function.arguments or ""))
            finish = ch.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("stream", [False, True])
def test_required_calls_always_parse_and_validate(tools_client, stream):
    seed0 = random.randrange(1 << 30)
    cases = [(k, seed0 + s) for k in (1, 2, 5) for s in range(10)]
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda c: _call(tools_client, TOOLS[:c[0]], c[1], stream, tool_choice="required"),
                             cases))
    for (k, seed), (calls, finish) in zip(cases, outs):
        assert finish == "tool_calls", (k, seed, calls)
        check_calls(calls, NAMES[:k])


@pytest.mark.parametrize("stream", [False, True])
def test_one_call_without_parallel_calls_and_for_a_named_function(tools_client, stream):
    seed0 = random.randrange(1 << 30)
    named = {"type": "function", "function": {"name": "book"}}
    cases = [dict(tool_choice="required", parallel_tool_calls=False)] * 5 + [dict(tool_choice=named)] * 5
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda i: _call(tools_client, TOOLS, seed0 + i, stream, **cases[i]), range(len(cases))))
    for kw, (calls, finish) in zip(cases, outs):
        assert finish == "tool_calls" and len(calls) == 1, (kw, calls)
        check_calls(calls, ["book"] if "function" in str(kw["tool_choice"]) else NAMES)


def test_tool_choice_with_response_format_or_unconstrainable_tools_is_400(tools_client):
    bad = [dict(tool_choice="required", response_format={"type": "json_object"}),
           dict(tool_choice="required", tools=[fn("f", {"a>b": S})])]
    for kw in bad:
        with pytest.raises(openai.BadRequestError) as ei:
            tools_client.chat.completions.create(**{"model": "tiny-0-0", "messages": [{"role": "user", "content": "x"}],
                                                     "max_tokens": 5, "tools": TOOLS, **kw})
        assert ei.value.status_code == 400 and ei.value.body["param"] in ("response_format", "tools"), kw
