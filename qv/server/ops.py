"""Operations endpoints: /health, /version, /metrics, /v1/models, /tokenize, /detokenize,
/reset_prefix_cache."""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from qv.engine.clef_api import CLEF_MODEL_NAMES
from qv.server.chat import apply_template, build_conversation, template_kwargs
from qv.server.errors import bad_request, error_response
from qv.server.openai import parse_body
from qv.server.protocol import DetokenizeRequest, TokenizeRequest
from qv.server.state import ServerState
from qv.server.streaming import read_json


async def health(state: ServerState, request: Request) -> Response:
    if not state.engine.healthy:
        return error_response(503, f"The engine is not running: {state.engine_failure()}")
    return Response(status_code=200)


async def version(state: ServerState, request: Request) -> Response:
    return JSONResponse({"version": __version__})


async def metrics(state: ServerState, request: Request) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def list_models(state: ServerState, request: Request) -> Response:
    """OpenAI's `data` list (what the openai SDK and GuideLLM read) plus a `models` list with
    `name` (what the SystemOne/TypeSafe SDKs read), where the Clef names join the served ones."""
    data = [{"id": name, "object": "model", "created": state.created, "owned_by": "qv", "root": state.model_root,
             "parent": None, "max_model_len": state.max_model_len, "permission": []} for name in state.served_names]
    clef = [n for n in CLEF_MODEL_NAMES if n not in state.served_names] if state.engine.clef_cap else []
    started = time.strftime("%Y-%m-%d", time.gmtime(state.created))  # the SDKs read a YYYY-MM-DD date
    models = [{"name": name, "description": f"{state.model_root} served by qv {__version__}",
               "release_date": started} for name in state.served_names + clef]
    return JSONResponse({"object": "list", "data": data, "models": models})


async def reset_prefix_cache(state: ServerState, request: Request) -> Response:
    """Forget every cached prefix (device and host tiers); running requests continue. 400 when
    prefix caching is off."""
    state.check_running()
    if not await state.engine.reset_prefix_cache():
        raise bad_request("prefix caching is off (QV_PREFIX_CACHING=0): there is no prefix cache to reset")
    return Response(status_code=200)


async def tokenize(state: ServerState, request: Request) -> Response:
    req = parse_body(TokenizeRequest, await read_json(request, state.max_body_bytes))
    state.check_model(req.model)
    tok = state.tokenizer
    if req.prompt is not None:
        ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    else:
        if not req.messages:
            raise bad_request("messages must not be empty", "messages")
        if req.add_generation_prompt and req.continue_final_message:
            raise bad_request("Cannot set both `continue_final_message` and `add_generation_prompt` to true.")
        text = apply_template(
            tok, build_conversation(req.messages),
            tools=[t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None,
            chat_template=req.chat_template, add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            kwargs=template_kwargs(req.chat_template_kwargs, state.enable_thinking, None))
        ids = tok.encode(text, add_special_tokens=False)
    body = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}
    if req.return_token_strs:
        body["token_strs"] = tok.convert_ids_to_tokens(ids)
    return JSONResponse(body)


async def detokenize(state: ServerState, request: Request) -> Response:
    req = parse_body(DetokenizeRequest, await read_json(request, state.max_body_bytes))
    state.check_model(req.model)
    vocab = state.engine.model_config.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {vocab})", "tokens")
    text = state.tokenizer.decode(req.tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return JSONResponse({"prompt": text})
