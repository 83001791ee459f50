"""The ASGI app (`uvicorn qv.server:app`) and `serve(cfg)` behind `qv serve`.

The engine is built in the app's lifespan, so importing this module is cheap and the model loads
when the server starts: from `cfg` when given, else from the QV_* levers (QV_MODEL unset: the
embedded tiny model, built into ~/.cache/qv on first start). `qv serve` builds it before uvicorn
starts, so an engine that cannot start (StartupError, ConfigError) ends the process with its message
and exit status 1 rather than inside uvicorn's lifespan traceback. Requests pass two pure-ASGI guards
first: the body-size limit (413) and, when an API key is set, Bearer auth on /v1/* (401).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from qv.config import ConfigError, EngineConfig
from qv.errors import StartupError
from qv.server import completions, ops, openai, responses, systemone
from qv.server.errors import APIError, api_error_response, error_response
from qv.server.state import ServerState
from qv.server.streaming import ClientDisconnected

log = logging.getLogger("qv.server")


class BodyTooLarge(Exception):
    pass


def _endpoint(handler):
    """Route adapter: hands the handler the ServerState and turns errors into JSON responses."""
    async def endpoint(request: Request) -> Response:
        state: ServerState = request.app.state.qv
        try:
            return await handler(state, request)
        except APIError as exc:
            return api_error_response(exc)
        except BodyTooLarge:
            return error_response(413, f"the request body is larger than {state.max_body_bytes} bytes")
        except ClientDisconnected:
            return Response(status_code=499)  # nobody is listening; the request was aborted
        except Exception as exc:  # noqa: BLE001 - a bug: log it, answer 500, keep serving
            log.exception("unhandled error in %s", request.url.path)
            return error_response(500, f"internal error: {type(exc).__name__}: {exc}")
    return endpoint


ROUTES = [
    ("/v1/chat/completions", openai.create_chat_completion, "POST"),
    ("/v1/completions", completions.create_completion, "POST"),
    ("/v1/responses", responses.create_response, "POST"),
    ("/v1/systemone", systemone.create_decision, "POST"),
    ("/v1/models", ops.list_models, "GET"),
    ("/health", ops.health, "GET"),
    ("/version", ops.version, "GET"),
    ("/metrics", ops.metrics, "GET"),
    ("/tokenize", ops.tokenize, "POST"),
    ("/detokenize", ops.detokenize, "POST"),
    ("/reset_prefix_cache", ops.reset_prefix_cache, "POST"),
]


class Guards:
    """Body-size limit and Bearer auth, before routing (so a 401/413 costs no JSON parsing)."""

    def __init__(self, app, cfg_ref: dict):
        self.app = app
        self.cfg_ref = cfg_ref

    async def __call__(self, scope, receive, send):
        cfg: EngineConfig | None = self.cfg_ref.get("cfg")
        if scope["type"] != "http" or cfg is None:
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if cfg.api_key and scope["path"].startswith("/v1/") and scope["method"] != "OPTIONS":
            given = headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {cfg.api_key}".encode()):
                return await error_response(401, "Unauthorized: send `Authorization: Bearer <api key>`",
                                            headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
        limit = cfg.max_body_bytes
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            return await error_response(413, f"the request body is larger than {limit} bytes")(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge()
            return message

        return await self.app(scope, limited_receive, send)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    if exc.status_code == 404:
        return error_response(404, f"no route {request.method} {request.url.path}")
    if exc.status_code == 405:
        return error_response(405, f"method {request.method} is not allowed on {request.url.path}")
    return error_response(exc.status_code, str(exc.detail))


def build_app(cfg: EngineConfig | None = None, engine=None) -> Starlette:
    """A Starlette app whose lifespan builds the engine from `cfg` (or the environment), unless given
    one built from `cfg` already (`serve`)."""
    cfg_ref: dict = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        from qv.engine.async_engine import AsyncLLMEngine

        config = cfg if cfg is not None else EngineConfig.from_env()
        running = engine if engine is not None else AsyncLLMEngine(config)
        app.state.qv = ServerState(running, config)
        cfg_ref["cfg"] = config
        log.info("qv server ready: model %s (%s), max_model_len %d", app.state.qv.model_name,
                 app.state.qv.model_root, running.max_model_len)
        try:
            yield
        finally:
            running.shutdown()

    routes = [Route(path, _endpoint(fn), methods=[method]) for path, fn, method in ROUTES]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _http_error})
    app.add_middleware(Guards, cfg_ref=cfg_ref)
    return app


app = build_app()


async def _serve(server, state_app: Starlette) -> None:
    task = asyncio.ensure_future(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        host, port = server.servers[0].sockets[0].getsockname()[:2]
        name = state_app.state.qv.model_name
        print(f"qv: serving model '{name}' at http://{host}:{port}/v1 (health: http://{host}:{port}/health)",
              flush=True)
    await task
    if not server.started:
        raise SystemExit("qv: the server did not start (see the error above)")


def serve(cfg: EngineConfig) -> None:
    """`qv serve`: build the engine, run uvicorn on cfg.host:cfg.port and print where it listens once it
    does. An engine that cannot start exits the process with its message (SystemExit, status 1)."""
    import uvicorn

    from qv.engine.async_engine import AsyncLLMEngine

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine = AsyncLLMEngine(cfg)  # here, not in the lifespan: uvicorn would bury the message in a traceback
    except (StartupError, ConfigError) as exc:
        raise SystemExit(f"qv: the engine did not start: {exc}") from None
    application = build_app(cfg, engine)
    server = uvicorn.Server(uvicorn.Config(application, host=cfg.host, port=cfg.port, log_level="info",
                                           lifespan="on", timeout_graceful_shutdown=5))
    asyncio.run(_serve(server, application))


__all__ = ["app", "build_app", "serve"]
