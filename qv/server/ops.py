"""Operations endpoints: /health and /ping (SageMaker's name for it), /version, /metrics, /v1/models, /v1/models/{model}, /tokenize,
/detokenize, /reset_prefix_cache."""

from __future__ import annotations

import time
from array import array

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from qv.clef.request import CLEF_MODEL_NAMES
from qv.server import lora
from qv.server.chat import apply_template, build_conversation, template_kwargs
from qv.server.errors import bad_request, error_response
from qv.server.openai import read_request
from qv.server.protocol import DetokenizeRequest, TokenizeRequest
from qv.server.state import ServerState
from qv.version import __version__


async def health(state: ServerState, request: Request) -> Response:
    if not state.engine.healthy:
        return error_response(503, "The engine is not running (it stopped; the server log says why).")
    return Response(status_code=200)


async def ping(state: ServerState, request: Request) -> Response:
    """SageMaker's health check (GET or POST), /health's answer."""
    return await health(state, request)


async def version(state: ServerState, request: Request) -> Response:
    return JSONResponse({"version": __version__})


async def metrics(state: ServerState, request: Request) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _model_object(state: ServerState, name: str) -> dict:
    return {"id": name, "object": "model", "created": state.created, "owned_by": "qv", "root": state.model_root,
            "parent": None, "max_model_len": state.max_model_len, "permission": []}


def _clef_names(state: ServerState) -> list[str]:
    return [n for n in CLEF_MODEL_NAMES if n not in state.served_names] if state.engine.clef_cap else []


async def list_models(state: ServerState, request: Request) -> Response:
    """OpenAI's `data` list (what the openai SDK and GuideLLM read) plus a `models` list with
    `name` (what the SystemOne/TypeSafe SDKs read), where the Clef names join the served ones."""
    data = [_model_object(state, name) for name in state.served_names] + lora.model_objects(state)
    started = time.strftime("%Y-%m-%d", time.gmtime(state.created))  # the SDKs read a YYYY-MM-DD date
    models = [{"name": name, "description": f"{state.model_root} served by qv {__version__}",
               "release_date": started} for name in state.served_names + _clef_names(state)]
    return JSONResponse({"object": "list", "data": data, "models": models})


async def retrieve_model(state: ServerState, request: Request) -> Response:
    """GET /v1/models/{model}: the model object of a served name or, when Clef is served, of a Clef
    name; OpenAI's 404 otherwise."""
    name = request.path_params["model"]
    adapter = next((m for m in lora.model_objects(state) if m["id"] == name), None)
    if adapter is not None:
        return JSONResponse(adapter)
    if name not in state.served_names and name not in _clef_names(state):
        return error_response(404, f"The model `{name}` does not exist.", "model")
    return JSONResponse(_model_object(state, name))


async def reset_prefix_cache(state: ServerState, request: Request) -> Response:
    """Forget every cached prefix (device and host tiers); running requests continue. 400 when
    prefix caching is off."""
    state.check_running()
    if not await state.engine.reset_prefix_cache():
        raise bad_request("prefix caching is off (QV_PREFIX_CACHING=0): there is no prefix cache to reset")
    return Response(status_code=200)


def _tokenize(state: ServerState, req: TokenizeRequest) -> list[int]:
    """The prompt's or the rendered chat's token ids, refused early when the text cannot fit
    max_model_len (the length pre-check); off the event loop."""
    tok = state.tokenizer
    if req.prompt is not None:
        state.check_text(req.prompt, None, "prompt")
        return state.encode(req.prompt, req.add_special_tokens)
    if not req.messages:
        raise bad_request("messages must not be empty", "messages")
    if req.add_generation_prompt and req.continue_final_message:
        raise bad_request("Cannot set both `continue_final_message` and `add_generation_prompt` to true.")
    text = apply_template(
        tok, build_conversation(req.messages),
        tools=[t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None,
        chat_template=req.chat_template, add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        kwargs=template_kwargs(req.chat_template_kwargs, state.enable_thinking, None),
        trust_template=state.trust_request_chat_template)
    state.check_text(text, None, "messages")
    return state.encode(text, False)


async def tokenize(state: ServerState, request: Request) -> Response:
    req, size = await read_request(state, request, TokenizeRequest)
    state.check_model(req.model)
    ids = await state.offload(size, _tokenize, state, req)
    body = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}
    if req.return_token_strs:
        body["token_strs"] = await state.offload(size, state.tokenizer.convert_ids_to_tokens, ids)
    return JSONResponse(body)


def _detokenize(state: ServerState, tokens: list[int]) -> str:
    vocab = state.engine.model_config.vocab_size
    try:  # C speed for long lists; the loop below only names the bad id
        ok = not tokens or (0 <= min(array("q", tokens)) and max(tokens) < vocab)
    except OverflowError:
        ok = False
    if not ok:
        bad = next(t for t in tokens if not 0 <= t < vocab)
        raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab})", "tokens")
    return state.decode(tokens)


async def detokenize(state: ServerState, request: Request) -> Response:
    req, size = await read_request(state, request, DetokenizeRequest)
    state.check_model(req.model)
    return JSONResponse({"prompt": await state.offload(size, _detokenize, state, req.tokens)})
