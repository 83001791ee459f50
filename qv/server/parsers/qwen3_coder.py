"""qwen3_coder tool-call parser: Qwen3.5's XML calls, non-streaming and streaming.

The model writes (research/qwen35.md 6.2):

    optional content<tool_call>
    <function=NAME>
    <parameter=ARG>
    VALUE (raw text, may span lines; JSON for objects and arrays)
    </parameter>
    </function>
    </tool_call>

Grammar (vLLM's `Qwen3CoderToolParser`, made exact so that streaming can match it):
- Tool mode needs a `<function=` at or after the first `<tool_call>`/`<function=` (whichever is
  first, at `s`); without one the whole output is content. Otherwise content is the text before
  `s` (None if empty) and the text between and after calls is dropped.
- Each `<function=` starts a call that ends at the first `</function>` or `</tool_call>`, or at
  the end of the output (unterminated). The name is the text up to the first `>`; a call whose
  header never closes is dropped. `<tool_call>` wrappers are optional, as in vLLM's fallback.
- Each `<parameter=` value ends at `</parameter>`, at the next `<parameter=`, or at the end of
  the call; one leading and one trailing newline are dropped. A repeated parameter keeps its
  first value (vLLM keeps the last; first-wins is what a stream can emit without retracting).
- Values are converted with the tool's JSON schema (`convert_param_value`, vLLM's rules); a property
  that is a local `$ref` is read as its target (vLLM reads it as text).
- Arguments are `json.dumps(args, ensure_ascii=False)`.

Streaming re-parses the text seen so far with `final=False`, which yields only what later text
cannot change, and sends the difference: content, then per call a header delta (id, type, name)
and argument fragments (`{`, each complete `"k": v` joined by `, `, then `}`). `finish()` parses
with `final=True` and sends the rest, so the streamed calls always equal `extract_tool_calls` on
the same text, whatever the chunk boundaries (tests check every boundary).

A forced parser (tool_choice `required` or a named function, whose output the call grammar holds)
takes as calls only those that end with `</tool_call>`. The text after the last of them, when not
blank, is a call that max_tokens or a stop string cut: it is the content (without the separator
before it), never a call. Its stream sends each call whole once its `</tool_call>` arrives, and the
cut text at `finish()`, so it equals `extract_tool_calls` as the unforced stream does.
"""

from __future__ import annotations

import ast
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from qv.server.parsers.markers import scan

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
FUNCTION_START = "<function="
FUNCTION_END = "</function>"
PARAM_START = "<parameter="
PARAM_END = "</parameter>"

STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def schema_type(schema: Any) -> tuple[str, bool]:
    """(primary type, allows null) of a property schema: `type` (a string or a list) or the
    first non-null branch of `anyOf`/`oneOf`; untyped properties count as strings."""
    if not isinstance(schema, dict):
        return "string", False
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        names = [str(t).strip().lower() for t in types]
        non_null = [t for t in names if t != "null"]
        return (non_null[0] if non_null else "null"), "null" in names
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            allows_null, primary = False, None
            for option in schema[key]:
                if isinstance(option, dict) and "type" in option:
                    t = str(option["type"]).strip().lower()
                    if t == "null":
                        allows_null = True
                    elif primary is None:
                        primary = t
            return primary or "string", allows_null
    return "string", False


def _json_safe(value: Any, fallback: str) -> Any:
    """`value` if it serialises as strict JSON (no NaN/Infinity, no sets/bytes), else the raw text."""
    try:
        json.dumps(value, allow_nan=False)
        return value
    except (TypeError, ValueError, RecursionError):
        return fallback


def convert_param_value(value: str, name: str, properties: dict[str, Any]) -> Any:
    """Convert one raw parameter value by the tool's JSON schema (vLLM `_convert_param_value`):
    unknown parameter or string types stay raw; null/None -> None for nullable or non-string
    types; int*/uint*/long/short/unsigned -> int; num*/float* -> float (int when integral);
    boolean/bool/binary -> value == "true"; object/array/dict*/list* -> json.loads, else
    ast.literal_eval; other types -> ast.literal_eval. Anything that fails stays a string."""
    if name not in properties:
        return value
    ptype, allows_null = schema_type(properties[name])
    if allows_null and value.lower() in ("null", "none"):
        return None
    if ptype in STRING_TYPES:
        return value
    if value.lower() in ("null", "none"):
        return None
    if ptype.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(value)
        except ValueError:
            return value
    if ptype.startswith(("num", "float")):
        try:
            f = float(value)
            return int(f) if f.is_integer() else _json_safe(f, value)
        except (ValueError, OverflowError):
            return value
    if ptype in ("boolean", "bool", "binary"):
        return value.lower() == "true"
    container = ptype in ("object", "array", "arr") or ptype.startswith(("dict", "list"))
    if container:
        try:
            parsed = json.loads(value)
            if isinstance(parsed, str):  # a JSON-encoded Python repr, e.g. "{'k': 'v'}"
                try:
                    parsed = ast.literal_eval(parsed)
                except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                    pass
            return _json_safe(parsed, value)
        except (ValueError, RecursionError):
            pass
    try:
        return _json_safe(ast.literal_eval(value), value)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return value


@dataclass
class ParsedCall:
    name: str
    args: dict[str, Any] = field(default_factory=dict)
    closed: bool = True  # False only while streaming: more parameters may follow

    def arguments_json(self) -> str:
        """The arguments as streamed so far; equals json.dumps(args) once closed."""
        body = ", ".join(
            f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}" for k, v in self.args.items()
        )
        return "{" + body + ("}" if self.closed else "")


@dataclass
class ToolCallParse:
    content: str  # stable content text ("" when none)
    calls: list[ParsedCall]
    tool_mode: bool  # a `<function=` follows the first call marker


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ExtractedToolCalls:
    content: str | None
    tool_calls: list[ToolCall]
    cut: bool = False  # forced: the output ends inside a call (the content), so not in the calls

    @property
    def tools_called(self) -> bool:
        return bool(self.tool_calls)


def local_ref(schema: Any, root: Any) -> Any:
    """A property schema that is a local `$ref` (`#/$defs/X`, `#/definitions/X`, as pydantic writes
    nested models) replaced by its target, its sibling keys kept; anything else as it is."""
    ref = schema.get("$ref") if isinstance(schema, dict) else None
    if not (isinstance(ref, str) and isinstance(root, dict)):
        return schema
    for defs in ("$defs", "definitions"):
        prefix = f"#/{defs}/"
        target = root.get(defs, {}).get(ref[len(prefix):]) if ref.startswith(prefix) else None
        if isinstance(target, dict):
            return {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
    return schema


def tool_properties(tools: list[dict] | None) -> dict[str, dict]:
    """Function name -> JSON-schema `properties` (local `$ref`s resolved), from chat-style tool dicts
    ({"type": "function", "function": {...}}) or bare function dicts ({"name", "parameters"})."""
    out: dict[str, dict] = {}
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters") or {}
            props = params.get("properties") if isinstance(params, dict) else None
            out[fn["name"]] = {k: local_ref(v, params) for k, v in props.items()} if isinstance(props, dict) else {}
    return out


def split_cut_call(text: str) -> tuple[str, str]:
    """(the calls that ended: `text` through its last `</tool_call>`, the cut call: what follows,
    without its leading separator, "" when blank) of a grammar-held output."""
    end = text.rfind(TOOL_CALL_END)
    end = 0 if end == -1 else end + len(TOOL_CALL_END)
    return text[:end], text[end:].lstrip()


class Qwen3CoderToolParser:
    """Stateless parser for one request's tools; `stream()` makes a per-choice streaming state.
    forced: the output is held to the call grammar, so a call it ends inside is text, not a call."""

    def __init__(self, tools: list[dict] | None = None, forced: bool = False):
        self.properties = tool_properties(tools)
        self.forced = forced

    def parse(self, text: str, final: bool = True, resume: "_Resume | None" = None) -> ToolCallParse:
        """Parse `text`; with `final` False keep only what later text cannot change. `resume`
        (streaming) carries the calls already closed and where they ended, so each new delta
        costs only the open call, not the whole output again."""
        if resume is not None and resume.pos >= 0:
            content, calls, pos = resume.content, list(resume.calls), text.find(FUNCTION_START, resume.pos)
        else:
            s, _, hold = scan(text, (TOOL_CALL_START, FUNCTION_START), 0, final)
            if s == -1:
                return ToolCallParse(text[:hold], [], False)
            pos = text.find(FUNCTION_START, s)
            if pos == -1:
                # final: never a call, all content; streaming: a call may still follow the marker
                return ToolCallParse(text if final else text[:s], [], False)
            content, calls = text[:s], []
            if resume is not None:
                resume.content, resume.pos = content, pos
        while pos != -1:
            call, end = self._parse_function(text, pos + len(FUNCTION_START), final, resume)
            if call is not None:
                calls.append(call)
            if end == -1:  # still open: nothing after it is decided
                break
            if resume is not None:
                resume.calls, resume.pos = list(calls), end
            pos = text.find(FUNCTION_START, end)
        return ToolCallParse(content, calls, True)

    def _parse_function(self, text: str, start: int, final: bool,
                        resume: "_Resume | None" = None) -> tuple[ParsedCall | None, int]:
        """Parse the call whose header starts at `start`; returns (call or None, end) where end
        is where the next call may begin, or -1 while the call is still open."""
        e, marker, hold = scan(text, (FUNCTION_END, TOOL_CALL_END), start, final)
        if e != -1:
            body, closed, end = text[start:e], True, e + len(marker)
        elif final:
            body, closed, end = text[start:], True, len(text)
        else:
            body, closed, end = text[start:hold], False, -1
        gt = body.find(">")
        if gt == -1:
            return None, end  # header not closed: dropped when the call ends, unknown before
        name = body[:gt]
        props = self.properties.get(name, {})
        memo = resume.converted if resume is not None else {}
        call = ParsedCall(name, {}, closed)
        for pname, raw in _parameters(body[gt + 1 :], closed):
            if pname not in call.args:
                key = (name, pname, raw)
                if key not in memo:
                    memo[key] = convert_param_value(raw, pname, props)
                call.args[pname] = memo[key]
        return call, end

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        if self.forced:
            ended, cut = split_cut_call(text)
            calls = self.parse(ended, final=True).calls if ended else []
            return ExtractedToolCalls(cut or None, [ToolCall(new_tool_call_id(), c.name, c.arguments_json())
                                                    for c in calls], bool(cut))
        parsed = self.parse(text, final=True)
        if not parsed.calls:
            return ExtractedToolCalls(text, [])
        calls = [ToolCall(new_tool_call_id(), c.name, c.arguments_json()) for c in parsed.calls]
        return ExtractedToolCalls(parsed.content or None, calls)

    def stream(self) -> "Qwen3CoderStream":
        return Qwen3CoderStream(self)


def _parameters(body: str, closed: bool):
    """Yield (name, raw value) for each parameter of a call body that is complete; when the call
    is closed the last parameter runs to the end of the body."""
    cursor = 0
    while True:
        q = body.find(PARAM_START, cursor)
        if q == -1:
            return
        cap = q + len(PARAM_START)
        e, marker, _ = scan(body, (PARAM_END, PARAM_START), cap, closed)
        if e == -1:
            if not closed:
                return
            e, marker = len(body), None
        capture = body[cap:e]
        cursor = e + len(PARAM_END) if marker == PARAM_END else e
        gt = capture.find(">")
        if gt == -1:
            continue
        value = capture[gt + 1 :]
        if value.startswith("\n"):
            value = value[1:]
        if value.endswith("\n"):
            value = value[:-1]
        yield capture[:gt], value


@dataclass
class _Resume:
    """Streaming cache: content and closed calls are final once tool mode is confirmed."""

    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)
    pos: int = -1  # where to look for the next call; -1 until tool mode is confirmed
    converted: dict = field(default_factory=dict)  # (function, parameter, raw) -> value


@dataclass
class StreamDelta:
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)  # OpenAI DeltaToolCall dicts

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


class Qwen3CoderStream:
    """Per-choice streaming state: feed the new text, get content and tool-call deltas."""

    def __init__(self, parser: Qwen3CoderToolParser):
        self.parser = parser
        self.text = ""
        self.sent_content = 0
        self.ids: list[str] = []
        self.sent_args: list[str] = []
        self.resume = _Resume()
        self.ended = 0  # forced: the length of the text through the last `</tool_call>`
        self.cut = False  # forced, after finish(): the output ends inside a call

    @property
    def tools_called(self) -> bool:
        return bool(self.ids)

    def feed(self, delta_text: str) -> StreamDelta:
        if self.parser.forced:  # a call goes out once it has ended: until then the limit may cut it
            start = max(self.ended, len(self.text) - len(TOOL_CALL_END) + 1)  # a new `</tool_call>` ends past it
            self.text += delta_text
            return self._forced(start, final=False)
        self.text += delta_text
        return self._diff(self.parser.parse(self.text, final=False, resume=self.resume))

    def finish(self) -> StreamDelta:
        if self.parser.forced:
            return self._forced(self.ended, final=True)
        parsed = self.parser.parse(self.text, final=True, resume=self.resume)
        if not parsed.calls:  # never a call after all: everything held back is content
            parsed = ToolCallParse(self.text, [], False)
        return self._diff(parsed)

    def _forced(self, start: int, final: bool) -> StreamDelta:
        """split_cut_call, as the text grows: new calls once they end, the cut text at the end."""
        end = self.text.rfind(TOOL_CALL_END, start)
        out = StreamDelta()
        if end != -1:
            self.ended = end + len(TOOL_CALL_END)
            out = self._diff(self.parser.parse(self.text[:self.ended], final=True))
        out.content = self.text[self.ended:].lstrip() if final else ""
        self.cut = bool(out.content)
        return out

    def _diff(self, parsed: ToolCallParse) -> StreamDelta:
        out = StreamDelta()
        if len(parsed.content) > self.sent_content:
            out.content = parsed.content[self.sent_content :]
            self.sent_content = len(parsed.content)
        for i, call in enumerate(parsed.calls):
            args = call.arguments_json()
            if i == len(self.ids):
                self.ids.append(new_tool_call_id())
                self.sent_args.append(args)
                out.tool_calls.append({"index": i, "id": self.ids[i], "type": "function",
                                       "function": {"name": call.name, "arguments": args}})
            elif len(args) > len(self.sent_args[i]):
                out.tool_calls.append({"index": i, "function": {"arguments": args[len(self.sent_args[i]) :]}})
                self.sent_args[i] = args
        return out
