"""qwen3_coder tool calls and qwen3 reasoning: non-streaming results on Qwen3.5-format outputs, and
streaming that reproduces them exactly at every chunk boundary."""

from __future__ import annotations

import json

import pytest

from qv.server.parsers import OutputStream, Qwen3CoderToolParser, convert_param_value, parse_output
from qv.server.parsers.qwen3_reasoning import prompt_ends_reasoning

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "unit": {"type": "string", "enum": ["c", "f"]}}}}}
AREA = {"type": "function", "function": {"name": "calculate_area", "parameters": {"type": "object", "properties": {
    "shape": {"type": "string"}, "dimensions": {"type": "object"}, "precision": {"type": "integer"},
    "scale": {"type": "number"}, "exact": {"type": "boolean"}, "tags": {"type": "array"},
    "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}, "limit": {"type": ["integer", "null"]}}}}}
WRITE = {"type": "function", "function": {"name": "write_file", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "content": {"type": "string"}}}}}
TOOLS = [WEATHER, AREA, WRITE]

# (name, model output as Qwen3.5 writes it after the prompt, expected content, expected calls)
CASES = [
    ("single", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
     "</parameter>\n</function>\n</tool_call>", None, [("get_weather", {"city": "Paris", "days": 3})]),
    ("content_then_call", "Let me check the weather for you.\n\n<tool_call>\n<function=get_weather>\n"
     "<parameter=city>\nSan José\n</parameter>\n<parameter=unit>\nc\n</parameter>\n</function>\n</tool_call>",
     "Let me check the weather for you.\n\n", [("get_weather", {"city": "San José", "unit": "c"})]),
    ("multiple", "<tool_call>\n<function=get_weather>\n<parameter=city>\nDallas\n</parameter>\n</function>\n"
     "</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOrlando\n</parameter>\n<parameter=days>\n"
     "2\n</parameter>\n</function>\n</tool_call>", None,
     [("get_weather", {"city": "Dallas"}), ("get_weather", {"city": "Orlando", "days": 2})]),
    ("multiline_param", "<tool_call>\n<function=write_file>\n<parameter=path>\n/tmp/a.py\n</parameter>\n"
     "<parameter=content>\ndef main():\n    print(\"hi\")\n\n    return 0\n</parameter>\n</function>\n</tool_call>",
     None, [("write_file", {"path": "/tmp/a.py", "content": "def main():\n    print(\"hi\")\n\n    return 0"})]),
    ("json_and_typed_args", "<tool_call>\n<function=calculate_area>\n<parameter=shape>\nrectangle\n</parameter>\n"
     "<parameter=dimensions>\n{\"width\": 10, \n \"height\": 20.5}\n</parameter>\n<parameter=precision>\n2\n</parameter>\n"
     "<parameter=scale>\n1.0\n</parameter>\n<parameter=exact>\nTrue\n</parameter>\n<parameter=tags>\n[\"a\", \"b\"]\n"
     "</parameter>\n<parameter=note>\nNone\n</parameter>\n<parameter=limit>\nnull\n</parameter>\n</function>\n</tool_call>",
     None, [("calculate_area", {"shape": "rectangle", "dimensions": {"width": 10, "height": 20.5}, "precision": 2,
                                "scale": 1, "exact": True, "tags": ["a", "b"], "note": None, "limit": None})]),
    ("unknown_params", "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<parameter=mood>\n"
     "42\n</parameter>\n</function>\n</tool_call>", None, [("get_weather", {"city": "Rome", "mood": "42"})]),
    ("unknown_function", "<tool_call>\n<function=lookup>\n<parameter=q>\n[1, 2]\n</parameter>\n</function>\n"
     "</tool_call>", None, [("lookup", {"q": "[1, 2]"})]),
    ("unterminated_tool_call", "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>",
     None, [("get_weather", {"city": "Oslo"})]),
    ("unterminated_function", "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
     "<parameter=days>\n5", None, [("get_weather", {"city": "Oslo", "days": 5})]),
    ("missing_param_end", "<tool_call>\n<function=get_weather>\n<parameter=city>\nLima\n<parameter=days>\n1\n"
     "</parameter>\n</function>\n</tool_call>", None, [("get_weather", {"city": "Lima", "days": 1})]),
    ("no_wrapper", "<function=get_weather>\n<parameter=city>\nKyiv\n</parameter>\n</function>", None,
     [("get_weather", {"city": "Kyiv"})]),
    ("header_never_closed", "Sure.<tool_call>\n<function=get_wea", "Sure.<tool_call>\n<function=get_wea", []),
    ("plain_text", "The answer is 42; no tools needed.", "The answer is 42; no tools needed.", []),
    ("mentions_tag", "Use the <tool_call> tag to call tools.", "Use the <tool_call> tag to call tools.", []),
    ("repeated_param_first_wins", "<tool_call>\n<function=get_weather>\n<parameter=city>\nA\n</parameter>\n"
     "<parameter=city>\nB\n</parameter>\n</function>\n</tool_call>", None, [("get_weather", {"city": "A"})]),
    ("two_calls_one_block", "<tool_call>\n<function=get_weather>\n<parameter=city>\nX\n</parameter>\n</function>\n"
     "<function=get_weather>\n</function>\n</tool_call>", None, [("get_weather", {"city": "X"}), ("get_weather", {})]),
]

# (name, output after a thinking prompt, reasoning, content, tool call names)
REASONING_CASES = [
    ("think_then_answer", "The user greets me.\n</think>\n\nHello! How can I help?", "The user greets me.\n",
     "\n\nHello! How can I help?", []),
    ("truncated_inside_think", "Let me think about <tool_call> tags and </thi", "Let me think about <tool_call> tags and </thi",
     None, []),
    ("think_then_tool", "Need weather.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
     "</parameter>\n</function>\n</tool_call>", "Need weather.\n", "\n\n", ["get_weather"]),
    ("implicit_end_at_tool_call", "I should call the tool.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nBern\n"
     "</parameter>\n</function>\n</tool_call>", "I should call the tool.\n", None, ["get_weather"]),
    ("tool_call_mention_not_end", "A <tool_call> alone is not a call.</think>done", "A <tool_call> alone is not a call.",
     "done", []),
    ("generated_think_tag", "  <think>hmm</think>ok", "hmm", "ok", []),
    ("empty_reasoning", "</think>\n\nJust content", None, "\n\nJust content", []),
]


def _stream(text: str, cuts: list[int], thinking: bool, tools) -> dict:
    stream = OutputStream(thinking, tools)
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    deltas = [stream.feed(p) for p in pieces] + [stream.finish()]
    out = {"reasoning": "", "content": "", "calls": {}}
    for d in deltas:
        out["reasoning"] += d.reasoning
        out["content"] += d.content
        for tc in d.tool_calls:
            call = out["calls"].setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in tc:
                assert call["id"] is None, "a tool call header was sent twice"
                call.update(id=tc["id"], name=tc["function"]["name"])
            assert call["id"] is not None, "arguments streamed before the call's header"
            call["arguments"] += tc["function"].get("arguments", "")
    assert sorted(out["calls"]) == list(range(len(out["calls"])))
    out["calls"] = [out["calls"][i] for i in range(len(out["calls"]))]
    return out


def _assert_stream_matches(text: str, thinking: bool, tools, cut_sets) -> int:
    expected = parse_output(text, thinking, tools)
    n = 0
    for cuts in cut_sets:
        got = _stream(text, cuts, thinking, tools)
        where = f"cuts={cuts[:8]}{'...' if len(cuts) > 8 else ''}"
        assert got["reasoning"] == (expected.reasoning or ""), where
        assert got["content"] == (expected.content or ""), where
        assert [(c["name"], c["arguments"]) for c in got["calls"]] == \
            [(c.name, c.arguments) for c in expected.tool_calls], where
        assert all(c["id"].startswith("call_") and len(c["id"]) == 29 for c in got["calls"])
        n += 1
    return n


def _every_boundary(text: str) -> list[list[int]]:
    """Each single cut, every character its own chunk, and every pair of cuts closer than the
    longest tag (so each tag is also split into three pieces at every place)."""
    cuts = [[i] for i in range(len(text) + 1)] + [list(range(1, len(text)))]
    cuts += [[i, j] for i in range(1, len(text)) for j in range(i + 1, min(i + 13, len(text)))]
    return cuts


@pytest.mark.parametrize("name,text,content,calls", CASES, ids=[c[0] for c in CASES])
def test_tool_calls_non_streaming(name, text, content, calls):
    out = parse_output(text, thinking=False, tools=Qwen3CoderToolParser(TOOLS))
    assert out.content == content
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == calls
    for c in out.tool_calls:  # arguments are exactly json.dumps of the dict (what clients re-parse)
        assert c.arguments == json.dumps(json.loads(c.arguments), ensure_ascii=False)


@pytest.mark.parametrize("name,text,content,calls", CASES, ids=[c[0] for c in CASES])
def test_tool_calls_stream_every_boundary(name, text, content, calls):
    assert _assert_stream_matches(text, False, Qwen3CoderToolParser(TOOLS), _every_boundary(text)) > len(text)


@pytest.mark.parametrize("name,text,reasoning,content,names", REASONING_CASES, ids=[c[0] for c in REASONING_CASES])
def test_reasoning_split(name, text, reasoning, content, names):
    out = parse_output(text, thinking=True, tools=Qwen3CoderToolParser(TOOLS))
    assert (out.reasoning, out.content, [c.name for c in out.tool_calls]) == (reasoning, content, names)
    _assert_stream_matches(text, True, Qwen3CoderToolParser(TOOLS), _every_boundary(text))


def test_thinking_off_and_no_tool_parsing():
    text = "a</think>b<tool_call>\n<function=f>\n</function>\n</tool_call>"
    out = parse_output(text, thinking=False, tools=None)
    assert (out.reasoning, out.content, out.tool_calls) == (None, text, [])
    _assert_stream_matches(text, False, None, _every_boundary(text))
    assert prompt_ends_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_ends_reasoning("<|im_start|>assistant\n<think>\n")


def test_stream_holds_back_partial_tags():
    """A partial `<tool_call>` is not sent as content until it turns out to be text."""
    s = OutputStream(False, Qwen3CoderToolParser(TOOLS))
    assert s.feed("Hi <tool_").content == "Hi "
    assert s.feed("x").content == "<tool_x"
    s = OutputStream(True, None)
    d = s.feed("abc</th")
    assert (d.reasoning, d.content) == ("abc", "")
    d = s.feed("ink>def")
    assert (d.reasoning, d.content) == ("", "def")


def test_stream_sends_parameters_as_they_complete():
    s = OutputStream(False, Qwen3CoderToolParser(TOOLS)).tools
    d = s.feed("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar")
    assert d.tool_calls == [{"index": 0, "id": s.ids[0], "type": "function",
                             "function": {"name": "get_weather", "arguments": "{"}}]
    assert s.feed("is\n</parameter>\n").tool_calls == [{"index": 0, "function": {"arguments": '"city": "Paris"'}}]
    assert s.feed("<parameter=days>\n4\n</parameter>\n</function>").tool_calls == [
        {"index": 0, "function": {"arguments": ', "days": 4}'}}]


@pytest.mark.parametrize("raw,schema,expected", [
    ("42", {"type": "integer"}, 42), ("4x", {"type": "integer"}, "4x"), ("3.5", {"type": "number"}, 3.5),
    ("2.0", {"type": "float"}, 2), ("nan", {"type": "number"}, "nan"), ("1e999", {"type": "number"}, "1e999"),
    ("TRUE", {"type": "boolean"}, True), ("yes", {"type": "boolean"}, False), ("null", {"type": "integer"}, None),
    ("null", {"type": "string"}, "null"), ("None", {"type": ["string", "null"]}, None),
    ("{'a': 1}", {"type": "object"}, {"a": 1}), ('"{\'a\': 1}"', {"type": "object"}, {"a": 1}),
    ("[1, 2", {"type": "array"}, "[1, 2"), ("{1, 2}", {"type": "object"}, "{1, 2}"),
    ("(1, 2)", {"type": "tuple"}, (1, 2)), ("x", {}, "x"), ("5", {"anyOf": [{"type": "integer"}, {"type": "null"}]}, 5),
])
def test_convert_param_value(raw, schema, expected):
    got = convert_param_value(raw, "p", {"p": schema})
    assert got == expected and type(got) is type(expected)
    json.dumps(got, allow_nan=False)  # always strict JSON


def test_unknown_parameter_stays_string():
    assert convert_param_value("42", "other", {"p": {"type": "integer"}}) == "42"
