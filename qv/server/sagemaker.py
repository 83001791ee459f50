"""POST /invocations, SageMaker's one inference route: the body's shape picks the API, as vLLM's
does (a chat completion body has `messages`, a completion body `prompt`), and that API answers it
whole (streaming included). /ping, SageMaker's health check, is ops.ping."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from qv.server import completions, openai
from qv.server.errors import bad_request
from qv.server.state import ServerState
from qv.server.streaming import read_json_sized


async def invocations(state: ServerState, request: Request) -> Response:
    body, _ = await read_json_sized(request, state.max_body_bytes)  # Request caches the body for the handler
    if "messages" in body:
        return await openai.create_chat_completion(state, request)
    if "prompt" in body:
        return await completions.create_completion(state, request)
    raise bad_request("Cannot find suitable handler for request. Expected one of: a chat completion body (with "
                      "`messages`) or a completion body (with `prompt`)")
