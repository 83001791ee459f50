"""GET /openapi.json and GET /docs: the OpenAPI 3.1 document of the routes the app serves, built
from the Starlette routes themselves and the pydantic models the handlers validate with (so the
document cannot list a route that is not served, or a body the server does not check), and a
Swagger UI page over it.

The docs page loads Swagger UI's script and stylesheet from the package `swagger-ui-bundle-v2` (served
at /docs/swagger-ui-bundle.js and /docs/swagger-ui.css, relative to the page, so no CDN and any path
prefix works); the document is inlined in the page, so the browser needs no second authenticated
request. Without that package the page is a plain list of the routes. Each operation's `security`
says whether the API key guards it under the server's api_key_scope (http_edges.needs_key).
"""

from __future__ import annotations

import functools
import html
import json
import re
from pathlib import Path

from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from qv.clef.request import SystemOneRequest
from qv.server import protocol
from qv.server.errors import error_response
from qv.server.http_edges import needs_key
from qv.server.state import ServerState
from qv.version import __version__

REF = "#/components/schemas/{model}"
SWAGGER_UI_FILES = {"swagger-ui-bundle.js": "text/javascript; charset=utf-8",
                    "swagger-ui.css": "text/css; charset=utf-8"}

# path -> (summary, request model or None, whether it answers SSE when the body asks `stream`)
OPERATIONS = {
    "/v1/chat/completions": ("Chat completion (OpenAI/vLLM fields)", protocol.ChatCompletionRequest, True),
    "/v1/completions": ("Text completion (OpenAI/vLLM fields)", protocol.CompletionRequest, True),
    "/v1/responses": ("Responses API (store, previous_response_id, background)", protocol.ResponsesRequest, True),
    "/v1/responses/{response_id}": ("A stored response: GET retrieves it as it stands, DELETE forgets it", None,
                                    False),
    "/v1/responses/{response_id}/cancel": ("Cancel a queued or running background response", None, False),
    "/v1/responses/{response_id}/input_items": ("The input items that led to a stored response (earlier turns "
                                                "included), OpenAI's cursor list", None, False),
    "/v1/systemone": ("Clef decision: probabilities for each question's options", SystemOneRequest, False),
    "/v1/models": ("The served model names (OpenAI list, plus `models` for the SystemOne SDKs)", None, False),
    "/v1/models/{model}": ("One served model (OpenAI model object)", None, False),
    "/health": ("200 while the engine runs, 503 when it stopped (never needs the API key)", None, False),
    "/ping": ("SageMaker's health check: /health's answer (never needs the API key)", None, False),
    "/invocations": ("SageMaker's inference route: a chat completion body (`messages`) or a completion body "
                     "(`prompt`), answered as that API answers it", None, True),
    "/version": ("qv's version", None, False),
    "/metrics": ("Prometheus metrics", None, False),
    "/tokenize": ("Token ids of a prompt or of a rendered chat", protocol.TokenizeRequest, False),
    "/detokenize": ("Text of token ids", protocol.DetokenizeRequest, False),
    "/reset_prefix_cache": ("Forget every cached prefix (400 when prefix caching is off)", None, False),
    "/openapi.json": ("This document", None, False),
    "/docs": ("Swagger UI over this document", None, False),
    "/docs/{name}": ("Swagger UI's script and stylesheet (`swagger-ui-bundle.js`, `swagger-ui.css`)", None, False),
    "/": ("The web playground: chat, Clef decisions and the server's state", None, False),
    "/playground": ("The web playground (as /)", None, False),
    "/static/{name}": ("The playground's script and stylesheet", None, False),
    "/server_info": ("The model, the levers that differ from their defaults, the memory plan, CUDA graphs",
                     None, False),
}

ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": "integer"}}}},
}
MODEL_SCHEMA = {
    "type": "object", "required": ["id", "object", "created", "owned_by"],
    "properties": {"id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
                   "owned_by": {"type": "string"}, "root": {"type": ["string", "null"]},
                   "parent": {"type": ["string", "null"]}, "max_model_len": {"type": ["integer", "null"]}},
}


def openapi_path(path: str) -> str:
    """Starlette's `{name:converter}` -> OpenAPI's `{name}`."""
    return re.sub(r"\{(\w+):\w+\}", r"{\1}", path)


def _schemas() -> tuple[dict, dict]:
    """({model class: $ref}, component schemas) of every request body."""
    models = [m for _, m, _ in OPERATIONS.values() if m is not None]
    refs, defs = models_json_schema([(m, "validation") for m in models], ref_template=REF)
    schemas = defs.get("$defs", {})
    for component in schemas.values():
        _required_when_default_refused(component)
    schemas["Error"] = ERROR_SCHEMA
    schemas["Model"] = MODEL_SCHEMA
    return {m: refs[(m, "validation")] for m in models}, schemas


def _required_when_default_refused(component: dict) -> None:
    """A `None` default that the field's own type refuses (pydantic's validate_default, as in a Clef
    question's `type`) is no default: the field is required."""
    for name, prop in component.get("properties", {}).items():
        types = prop.get("type")
        if "default" in prop and prop["default"] is None and types is not None and "null" not in types:
            del prop["default"]
            component.setdefault("required", []).append(name)


def _request_body(path: str, ref: dict) -> dict:
    content = {"application/json": {"schema": ref}}
    if path == "/v1/systemone":  # the TypeSafe SDK's form: a `request` part (the JSON) and its asset parts
        content["multipart/form-data"] = {"schema": {
            "type": "object", "required": ["request"],
            "properties": {"request": {"type": "string", "description": "the JSON body"}},
            "additionalProperties": {"type": "string", "format": "binary"}}}
    return {"required": True, "content": content}


def _responses(path: str, streams: bool) -> dict:
    ok: dict = {"description": "OK"}
    if path == "/v1/models/{model}":
        ok["content"] = {"application/json": {"schema": {"$ref": REF.format(model="Model")}}}
    elif path == "/metrics":
        ok["content"] = {"text/plain": {"schema": {"type": "string"}}}
    elif path in ("/docs", "/", "/playground"):
        ok["content"] = {"text/html": {"schema": {"type": "string"}}}
    elif path in ("/docs/{name}", "/static/{name}"):
        ok["content"] = {"text/plain": {"schema": {"type": "string"}}}
    elif path not in ("/health", "/ping", "/reset_prefix_cache"):
        ok["content"] = {"application/json": {"schema": {"type": "object"}}}
    if streams:
        ok.setdefault("content", {})["text/event-stream"] = {"schema": {"type": "string"}}
    error = {"description": "An error, vLLM's shape", "content": {
        "application/json": {"schema": {"$ref": REF.format(model="Error")}}}}
    return {"200": ok, "4XX": error, "5XX": error}


def _operation(path: str, name: str, method: str, refs: dict, guarded: bool) -> dict:
    summary, model, streams = OPERATIONS.get(path, (name, None, False))
    op: dict = {"operationId": f"{name}_{method.lower()}", "summary": summary,
                "responses": _responses(path, streams)}
    if model is not None:
        op["requestBody"] = _request_body(path, refs[model])
    params = re.findall(r"\{(\w+)\}", path)
    if params:
        op["parameters"] = [{"name": p, "in": "path", "required": True, "schema": {"type": "string"}}
                            for p in params]
    if guarded:
        op["security"] = [{"bearer": []}]
    return op


@functools.lru_cache(maxsize=4)
def _document(routes: tuple[tuple[str, str, tuple[str, ...]], ...], scope: str, metrics_public: bool) -> str:
    refs, schemas = _schemas()
    paths: dict = {}
    for path, name, methods in routes:
        for method in methods:
            paths.setdefault(openapi_path(path), {})[method.lower()] = _operation(
                openapi_path(path), name, method, refs, needs_key(path, scope, metrics_public))
    doc = {
        "openapi": "3.1.0",
        "info": {"title": "qv", "version": __version__,
                 "description": "OpenAI- and vLLM-compatible server for Qwen3.5 hybrid models, with Clef decisions."},
        "paths": paths,
        "components": {"schemas": schemas,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                                      "description": "the server's API key, when one is set"}}},
    }
    return json.dumps(doc)


def document(routes, scope: str = "v1", metrics_public: bool = False) -> dict:
    """The OpenAPI document of Starlette routes (HEAD, which Starlette adds to GET, left out), its
    `security` marks under api_key_scope `scope`."""
    key = tuple((r.path, r.name, tuple(sorted(m for m in (r.methods or ()) if m != "HEAD")))
                for r in routes if isinstance(r, Route))
    return json.loads(_document(key, scope, metrics_public))


async def schema(state: ServerState, request: Request) -> Response:
    return JSONResponse(document(request.app.routes, state.api_key_scope, state.metrics_public))


def swagger_ui_dir() -> Path | None:
    """The folder of Swagger UI's files (the package swagger-ui-bundle-v2), or None without it."""
    try:
        from swagger_ui_bundle import swagger_ui_path
    except ImportError:
        return None
    return Path(swagger_ui_path)


def docs_html(doc: dict) -> str:
    """Swagger UI over `doc`, inlined; a plain list of the routes shows until (or unless) it loads."""
    rows = "".join(f"<li><code>{html.escape(m.upper())} {html.escape(p)}</code> {html.escape(op['summary'])}</li>"
                   for p, ops in doc["paths"].items() for m, op in ops.items())
    spec = json.dumps(doc).replace("<", "\\u003c")  # no `</script>` can end the script early
    ui = swagger_ui_dir() is not None
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>qv API</title>
<link rel="icon" href="data:,">{'<link rel="stylesheet" href="docs/swagger-ui.css">' if ui else ''}</head>
<body><div id="swagger-ui"><h1>qv {html.escape(__version__)} API</h1>
<p>The OpenAPI document is at <a href="openapi.json">/openapi.json</a>. Routes:</p><ul>{rows}</ul></div>
{'<script src="docs/swagger-ui-bundle.js"></script>' if ui else ''}
<script>if (window.SwaggerUIBundle) {{ SwaggerUIBundle({{spec: {spec}, dom_id: "#swagger-ui"}}); }}</script>
</body></html>"""


async def docs(state: ServerState, request: Request) -> Response:
    return HTMLResponse(docs_html(document(request.app.routes, state.api_key_scope, state.metrics_public)))


async def docs_asset(state: ServerState, request: Request) -> Response:
    """GET /docs/{name}: Swagger UI's script or stylesheet from the installed package."""
    name, folder = request.path_params["name"], swagger_ui_dir()
    if name not in SWAGGER_UI_FILES or folder is None:
        missing = "" if folder else " (swagger-ui-bundle-v2 is not installed)"
        return error_response(404, f"no docs file {name[:100]!r}{missing}")
    return FileResponse(folder / name, media_type=SWAGGER_UI_FILES[name], headers={"Cache-Control": "max-age=86400"})
