"""Structured outputs at the API: the request's constraint (protocol.py's `constraint`), or the
tool-call grammar of tool_choice `required` / a named function, compiled by the engine
(LLMEngine.compile_grammar, cached per spec, in its compile worker processes) and waited for on the
server's own grammar threads, never on the event loop or the threads that render chats."""

from __future__ import annotations

import asyncio
import json
import threading

from qv.engine.request import InvalidFieldError, InvalidRequestError
from qv.engine.structured import GrammarBusy, GrammarCancelled
from qv.server.chat import forces_call
from qv.server.errors import BUSY_MESSAGE, APIError, bad_request
from qv.server.streaming import ClientDisconnected, until_disconnect
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


async def compile_constraint(state, req, names: dict | None = None, request=None):
    """The Grammar for SamplingParams.grammar, or None when the request sets no constraint. A bad
    schema, regex or grammar, one over a grammar_* limit or over the compile budget is a 400 naming
    the field it came from; 503 while every compile worker is taken. The compile runs in a worker
    process (the engine's), waited for on the server's grammar threads, never the threads that
    render chats; a client that disconnects (`request`) kills its compile at once."""
    c = req.constraint
    calls = forces_call(getattr(req, "tool_choice", None), getattr(req, "tools", None))
    if c is not None and calls:
        field = (names or {}).get(c[2], c[2])
        raise bad_request(f"{field} cannot be combined with tool_choice required or a named function, which "
                          "constrains the output to tool calls", field)
    if c is None and not calls:
        return None
    cancel = threading.Event()

    def build():
        kind, spec, param = c if c is not None else tool_call_constraint(req)
        return state.engine.compile_grammar(kind, spec, param, cancel)

    if state.grammar_waiters >= state.max_grammar_waiters:
        state.metrics.rejections.inc()
        raise APIError(503, BUSY_MESSAGE, headers={"Retry-After": "1", "retry-after-ms": "1000"})
    state.grammar_waiters += 1
    try:
        work = asyncio.get_running_loop().run_in_executor(state.grammar_pool, build)
        return await (until_disconnect(request, work) if request is not None else work)
    except InvalidRequestError as exc:
        raise state.refusal(exc, names=names) from None
    except GrammarBusy:
        state.metrics.rejections.inc()
        raise APIError(503, BUSY_MESSAGE, headers={"Retry-After": "1", "retry-after-ms": "1000"}) from None
    except GrammarCancelled:
        raise ClientDisconnected() from None
    finally:
        cancel.set()  # a compile still running for a client that left: its worker process is killed
        state.grammar_waiters -= 1


def constraint_field(req, names: dict | None = None) -> str:
    """The request field a grammar came from, for an error that stops it while it runs."""
    field = req.constraint[2] if req.constraint is not None else "tools"
    return (names or {}).get(field, field)


def check_not_thinking(rendered, req) -> None:
    """A grammar constrains the output from its first token, so an output that opens in a think
    block would put the constrained text into the reasoning: refused rather than mis-parsed."""
    if req.constraint is not None and rendered.thinking:
        raise bad_request("structured outputs need thinking off: the grammar applies from the first output "
                          "token; set chat_template_kwargs.enable_thinking=false", req.constraint[2])
