"""The web playground (GET / and /playground, its files under /static/) and GET /server_info, the
JSON its Server panel reads beside /metrics.

The page, its script and stylesheet are files of the package (qv/server/static/), loaded with no
CDN and no build step. Every URL the page uses is relative, so it works behind a proxy that serves
qv under a path prefix (`--root-path`). /server_info says what a person wants to know about the
running server: the model, the levers that differ from their defaults (the API key and other
secrets left out), the memory plan and whether decode replays CUDA graphs.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response

from qv.config import EngineConfig
from qv.server.errors import error_response
from qv.server.state import ServerState
from qv.version import __version__

STATIC = Path(str(resources.files("qv.server") / "static"))
STATIC_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
SECRET_LEVERS = ("api_key",)  # never shown, even to a client that holds the key
NO_CACHE = {"Cache-Control": "no-cache"}  # a restarted server's page is the new one
# the files served, by name: a request's name is looked up, never joined to a path (no traversal, no OS errors)
FILES = {p.name: p for p in STATIC.iterdir() if p.suffix in STATIC_TYPES and p.is_file()}


async def page(state: ServerState, request: Request) -> Response:
    """GET /playground: the playground page."""
    return FileResponse(STATIC / "playground.html", media_type=STATIC_TYPES[".html"], headers=NO_CACHE)


async def index(state: ServerState, request: Request) -> Response:
    """GET /: the playground page (its own function: OpenAPI's operation ids are the handlers' names)."""
    return await page(state, request)


async def static_file(state: ServerState, request: Request) -> Response:
    """GET /static/{name}: one of the playground's files; nothing outside the folder, no listing."""
    name = request.path_params["name"]
    path = FILES.get(name)
    if path is None:
        return error_response(404, f"no playground file {name[:100]!r}")
    return FileResponse(path, media_type=STATIC_TYPES[path.suffix], headers=NO_CACHE)


def levers_changed(cfg: EngineConfig) -> dict:
    """Every lever whose value differs from its default, secrets and the model folder aside."""
    default = EngineConfig()
    return {name: _plain(getattr(cfg, name)) for name in EngineConfig.model_fields
            if name not in ("model", *SECRET_LEVERS) and getattr(cfg, name) != getattr(default, name)}


def _plain(value):
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


def _memory_plan(plan) -> dict | None:
    if plan is None:
        return None
    return {"summary": plan.summary(), **plan.as_dict()}


def server_info(state: ServerState, cfg: EngineConfig) -> dict:
    engine = state.engine.engine  # the LLMEngine inside the async wrapper
    runner = getattr(engine, "runner", None)
    return {
        "version": __version__,
        "model": state.model_name,
        "served_names": state.served_names,
        "model_root": state.model_root,
        "max_model_len": state.max_model_len,
        "clef": state.engine.clef_cap is not None,
        "images": state.engine.multimodal is not None and state.engine.media_off is None,
        "device": str(getattr(getattr(runner, "model", None), "device", cfg.device)),
        "cuda_graphs": getattr(runner, "graphs", None) is not None,
        "cuda_graph_sizes": list(engine.stats.cuda_graph_sizes),
        "spec": cfg.spec,
        "levers_changed": levers_changed(cfg),
        "memory_plan": _memory_plan(getattr(engine, "memory_plan", None)),
        "api_key_required": bool(cfg.api_key),
    }


async def info(state: ServerState, request: Request) -> Response:
    """GET /server_info (vLLM's name for its own): what the Server panel shows."""
    return JSONResponse(server_info(state, request.app.state.qv_config))
