"""Structured outputs at the API: the request's constraint (protocol.py's `constraint`), or the
tool-call grammar of tool_choice `required` / a named function, compiled by the engine
(LLMEngine.compile_grammar, cached per spec) on a worker thread, never on the event loop."""

from __future__ import annotations

import asyncio
import json

from qv.engine.request import InvalidFieldError, InvalidRequestError
from qv.server.chat import forces_call
from qv.server.errors import bad_request
from qv.server.parsers.qwen3_coder_grammar import ToolGrammarError, tool_call_tag


def tool_call_constraint(req) -> tuple[str, str, str]:
    """("structural_tag", the qwen3_coder call grammar as JSON, "tools") of a request that forces a call."""
    choice = req.tool_choice
    forced = None if isinstance(choice, str) else choice.function.name
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    try:
        tag = tool_call_tag(tools, forced, req.parallel_tool_calls)
    except ToolGrammarError as exc:
        raise InvalidFieldError(f"tool_choice={'required' if forced is None else forced!r} constrains the call to "
                                f"the tool's schema, which cannot be done here: {exc}", "tools") from None
    return "structural_tag", json.dumps(tag), "tools"


async def compile_constraint(state, req, names: dict | None = None):
    """The Grammar for SamplingParams.grammar, or None when the request sets no constraint. A bad
    schema, regex or grammar is a 400 naming the field it came from."""
    c = req.constraint
    calls = forces_call(getattr(req, "tool_choice", None), getattr(req, "tools", None))
    if c is not None and calls:
        field = (names or {}).get(c[2], c[2])
        raise bad_request(f"{field} cannot be combined with tool_choice required or a named function, which "
                          "constrains the output to tool calls", field)
    if c is None and not calls:
        return None

    def build():
        kind, spec, param = c if c is not None else tool_call_constraint(req)
        return state.engine.compile_grammar(kind, spec, param)

    try:
        return await asyncio.to_thread(build)
    except InvalidRequestError as exc:
        raise state.refusal(exc, names=names) from None


def check_not_thinking(rendered, req) -> None:
    """A grammar constrains the output from its first token, so an output that opens in a think
    block would put the constrained text into the reasoning: refused rather than mis-parsed."""
    if req.constraint is not None and rendered.thinking:
        raise bad_request("structured outputs need thinking off: the grammar applies from the first output "
                          "token; set chat_template_kwargs.enable_thinking=false", req.constraint[2])
