"""LoRA adapters over HTTP, as vLLM serves them: `model` naming an adapter runs the request on it,
/v1/models lists the adapters with their `parent`, and /v1/load_lora_adapter and
/v1/unload_lora_adapter change the set at run time when allow_runtime_lora_updating is on (vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING). The engine side is qv/engine/lora_rows.py.

A request's adapter travels from the `model` check to the engine call in a context variable: both run
in the request's task (check_model, then ServerState.generate), so no route has to thread it along."""

from __future__ import annotations

import asyncio
import contextvars

from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from qv.errors import LoraError
from qv.server.errors import APIError, bad_request, validation_error
from qv.server.streaming import read_json_sized

REQUEST_ADAPTER: contextvars.ContextVar[str | None] = contextvars.ContextVar("qv_request_adapter", default=None)
RUNTIME_OFF = ("Loading and unloading LoRA adapters at run time is off; start the server with "
               "--allow-runtime-lora-updating 1 (QV_ALLOW_RUNTIME_LORA_UPDATING=1, vLLM's "
               "VLLM_ALLOW_RUNTIME_LORA_UPDATING)")


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None


def adapter_for(state, name: str | None) -> str | None:
    """The adapter `model` names (None: the base model or not an adapter); sets it for this request's engine call."""
    lora = getattr(state.engine, "lora", None)
    if lora is None or name is None or name in state.served_names:
        REQUEST_ADAPTER.set(None)
        return None
    try:
        lora.resolve(name)
    except LoraError:
        return None
    REQUEST_ADAPTER.set(name)
    return name


def model_objects(state) -> list[dict]:
    """/v1/models entries of the served adapters (vLLM's: root = the adapter's path, parent = the base name)."""
    lora = getattr(state.engine, "lora", None)
    if lora is None:
        return []
    return [{"id": name, "object": "model", "created": state.created, "owned_by": "qv", "root": path,
             "parent": state.model_name, "max_model_len": state.max_model_len, "permission": []}
            for name, path in lora.names()]


def _lora(state):
    lora = getattr(state.engine, "lora", None)
    if lora is None:
        raise bad_request("LoRA adapters are not served: start the server with --enable-lora")
    if not state.allow_runtime_lora_updating:
        raise bad_request(RUNTIME_OFF)
    return lora


async def _read(state, request: Request, model_cls):
    body, _ = await read_json_sized(request, state.max_body_bytes)
    try:
        return model_cls.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


def _refusal(exc: LoraError, param: str) -> APIError:
    return APIError(exc.status, str(exc), param)


async def load_lora_adapter(state, request: Request) -> Response:
    lora = _lora(state)
    req = await _read(state, request, LoadLoRAAdapterRequest)
    if req.load_inplace:
        raise bad_request("load_inplace is not supported: unload the adapter, then load it again", "load_inplace")
    try:
        await asyncio.to_thread(lora.load, req.lora_name, req.lora_path, tuple(state.served_names))
    except LoraError as exc:
        raise _refusal(exc, "lora_path" if "(" in str(exc) else "lora_name") from None
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


async def unload_lora_adapter(state, request: Request) -> Response:
    lora = _lora(state)
    req = await _read(state, request, UnloadLoRAAdapterRequest)
    try:
        lora.unload(req.lora_name)
    except LoraError as exc:
        raise _refusal(exc, "lora_name") from None
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")


ROUTES = [
    ("/v1/load_lora_adapter", load_lora_adapter, "POST"),
    ("/v1/unload_lora_adapter", unload_lora_adapter, "POST"),
]
