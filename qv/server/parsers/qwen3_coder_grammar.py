"""The grammar of qwen3_coder tool calls, for tool_choice `required` and a named function: an
xgrammar structural tag (JSON, compiled by the engine) whose every complete output
`Qwen3CoderToolParser` reads as calls of the given tools with arguments valid for their schemas.

One call is the chat template's (qv/model/chat_template.jinja), parameters in schema order:

    <tool_call>\\n<function=NAME>\\n
    <parameter=P>\\nVALUE\\n</parameter>\\n      (each required parameter; optional ones may be left out)
    </function>\\n</tool_call>

and several calls are joined by "\\n", as the template writes them. Each VALUE is what the parser
turns into a value of the parameter's schema (`convert_param_value` picks by `schema_type`):
- string types: raw text. Text with an enum or const is one of its string values; with a pattern,
  that regex; with minLength/maxLength, printable ASCII of that length; otherwise any text
  (`format` is an annotation here, as jsonschema treats it by default).
- integer, number, boolean, null, object, array: compact JSON valid for the schema's branch of that
  type (plus `null` when the schema allows it), at most one blank between JSON tokens.
Neither kind of value contains the markers where the parser ends a value or a call.
"""

from __future__ import annotations

from typing import Any

from qv.engine.structured import bounded_strings
from qv.server.parsers.qwen3_coder import (FUNCTION_END, FUNCTION_START, PARAM_END, PARAM_START, STRING_TYPES,
                                           TOOL_CALL_END, TOOL_CALL_START, local_ref, schema_type)

VALUE_MARKERS = [PARAM_START, PARAM_END, FUNCTION_END, TOOL_CALL_END]  # the parser cuts a value or a call at these
RAW_BOUNDED_CHARS = "[ -;=-~]"  # printable ASCII but "<", so no marker fits in a length-bounded raw value
JSON_BOUNDED_CHARS = '[ !#-;=-\\[\\]-~]'  # the same in JSON strings, also without `"` and `\`
CALL_SEPARATOR = "\n"


class ToolGrammarError(ValueError):
    """A tool whose calls cannot be constrained; the message names the tool and parameter."""


def _const(text: str) -> dict:
    return {"type": "const_string", "value": text}


def _json_type(ptype: str) -> str | None:
    """The JSON-schema type the parser converts a value of `ptype` to (its `convert_param_value` rules)."""
    if ptype.startswith(("int", "uint", "long", "short", "unsigned")):
        return "integer"
    if ptype.startswith(("num", "float")):
        return "number"
    if ptype in ("boolean", "bool", "binary"):
        return "boolean"
    if ptype == "object" or ptype.startswith("dict"):
        return "object"
    if ptype in ("array", "arr") or ptype.startswith("list"):
        return "array"
    return "null" if ptype == "null" else None


def _branch(schema: Any, ptype: str) -> dict:
    """The part of a property schema that `schema_type` took its primary type from."""
    if not isinstance(schema, dict):
        return {}
    if "type" in schema:
        return schema
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key) if isinstance(schema.get(key), list) else []:
            if isinstance(option, dict) and str(option.get("type", "")).strip().lower() == ptype:
                return option
    return schema


def _raw_value(schema: dict, where: str) -> dict | None:
    """The format of a raw-text value, or None for any text."""
    if "enum" in schema or "const" in schema:
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        if not isinstance(values, list):
            raise ToolGrammarError(f"{where}: enum must be a list of values")
        texts = [v for v in values if isinstance(v, str) and not any(m in v for m in VALUE_MARKERS)]
        if not texts:
            raise ToolGrammarError(f"{where}: the qwen3_coder parser reads this parameter as text, but none of its "
                                   "enum/const values is a string")
        return _const(texts[0]) if len(texts) == 1 else {"type": "or", "elements": [_const(t) for t in texts]}
    if isinstance(schema.get("pattern"), str):
        return {"type": "regex", "pattern": schema["pattern"]}
    lo, hi = schema.get("minLength", 0), schema.get("maxLength", "")
    if (lo or hi != "") and isinstance(lo, int) and (hi == "" or isinstance(hi, int)):
        return {"type": "regex", "pattern": f"{RAW_BOUNDED_CHARS}{{{lo},{hi}}}"}
    return None


def _json_value(schema: dict, json_type: str, nullable: bool, params: dict) -> dict:
    branch = dict(schema, type=json_type)  # a typed branch: its type in the JSON-schema spelling
    if nullable and json_type != "null":
        branch = {"anyOf": [branch, {"type": "null"}]}
    for defs in ("$defs", "definitions"):  # nested `$ref`s resolve against the parameters' definitions
        if isinstance(params.get(defs), dict):
            branch[defs] = params[defs]
    return {"type": "json_schema", "json_schema": bounded_strings(branch, JSON_BOUNDED_CHARS), "max_whitespace_cnt": 1,
            "excludes": VALUE_MARKERS}


def _parameter(name: str, schema: Any, params: dict, where: str) -> dict:
    begin, end = f"{PARAM_START}{name}>\n", f"\n{PARAM_END}\n"
    ptype, nullable = schema_type(schema)
    branch = _branch(schema, ptype)
    if ptype in STRING_TYPES:
        value = _raw_value(branch, where)
        if value is None:
            return {"type": "tag", "begin": begin, "content": {"type": "any_text", "excludes": VALUE_MARKERS},
                    "end": end}
    else:
        json_type = _json_type(ptype)
        if json_type is None:
            raise ToolGrammarError(f"{where}: type {ptype!r} is not a JSON-schema type the qwen3_coder parser converts")
        value = _json_value(branch, json_type, nullable, params)
    return {"type": "sequence", "elements": [_const(begin), value, _const(end)]}


def _call(function: dict, where: str) -> dict:
    params = function.get("parameters") or {}
    props = params.get("properties") or {}
    required = set(params.get("required") or [])
    elements = [_const(f"{TOOL_CALL_START}\n{FUNCTION_START}{function['name']}>\n")]
    for name, schema in props.items():
        if not name or any(c in name for c in "<>\n"):
            raise ToolGrammarError(f"{where}.parameters.properties: the name {name!r} cannot be written as "
                                   "`<parameter=NAME>` (it must be non-empty, without '<', '>' or newlines)")
        p = _parameter(name, local_ref(schema, params), params, f"{where}.parameters.properties.{name}")
        elements.append(p if name in required else {"type": "optional", "content": p})
    elements.append(_const(f"{FUNCTION_END}\n{TOOL_CALL_END}"))
    return {"type": "sequence", "elements": elements}


def tool_call_tag(tools: list[dict], forced: str | None, parallel: bool) -> dict:
    """The structural tag for chat-style tool dicts: exactly one call of `forced` (a named
    tool_choice), else (`required`) one call of any tool, or one or more with `parallel`."""
    calls = [_call(t["function"], f"tools[{i}].function") for i, t in enumerate(tools)
             if forced is None or t["function"]["name"] == forced]
    if not calls:  # an empty alternative would compile to a grammar no output completes
        names = ", ".join(t["function"]["name"] for t in tools) or "none"
        raise ToolGrammarError(f"tool_choice names {forced!r}, which is not among the tools ({names})" if forced
                               else "tool_choice required needs at least one tool")
    one = calls[0] if len(calls) == 1 else {"type": "or", "elements": calls}
    if forced is None and parallel:
        more = {"type": "star", "content": {"type": "sequence", "elements": [_const(CALL_SEPARATOR), one]}}
        one = {"type": "sequence", "elements": [one, more]}
    return {"type": "structural_tag", "format": one}
