"""Structured outputs at the API: the request's constraint (protocol.py's `constraint`) compiled by
the engine (LLMEngine.compile_grammar, cached) on a worker thread, never on the event loop."""

from __future__ import annotations

import asyncio

from qv.engine.request import InvalidRequestError
from qv.server.errors import bad_request


async def compile_constraint(state, req, names: dict | None = None):
    """The Grammar for SamplingParams.grammar, or None when the request sets no constraint. A bad
    schema, regex or grammar is a 400 naming the field it came from."""
    c = req.constraint
    if c is None:
        return None
    kind, spec, param = c
    try:
        return await asyncio.to_thread(state.engine.compile_grammar, kind, spec, param)
    except InvalidRequestError as exc:
        raise state.refusal(exc, names=names) from None


def check_not_thinking(rendered, req) -> None:
    """A grammar constrains the output from its first token, so an output that opens in a think
    block would put the constrained text into the reasoning: refused rather than mis-parsed."""
    if req.constraint is not None and rendered.thinking:
        raise bad_request("structured outputs need thinking off: the grammar applies from the first output "
                          "token; set chat_template_kwargs.enable_thinking=false", req.constraint[2])
