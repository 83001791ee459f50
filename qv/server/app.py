"""The ASGI app (`uvicorn qv.server:app`) and `serve(cfg)` behind `qv serve`.

The engine is built in the app's lifespan, so importing this module is cheap and the model loads
when the server starts: from `cfg` when given, else from the QV_* levers (QV_MODEL unset: the
embedded tiny model, built into the state directory on first start). `qv serve` builds it before uvicorn
starts, so an engine that cannot start (StartupError, ConfigError) ends the process with its message
and exit status 1 rather than inside uvicorn's lifespan traceback.

Requests are timed and counted (http_edges.MeasureHTTP), pass CORS (vLLM's flags) and then a
pure-ASGI guard: Bearer auth on the routes api_key_scope names when an API key is set (401;
http_edges.needs_key), the body-size limit (413) and the body-read timeout (408). SIGTERM (or Ctrl+C) drains, under `qv serve` and plain uvicorn alike (`_drain_on_signals`):
new requests (and /health) get 503, requests in flight may finish until the grace is nearly over,
then streams end with an error event and `[DONE]`, other requests get a JSON 503, and the process
exits within shutdown_grace_s; a second signal changes nothing. Connection levers (header-read and
keep-alive timeouts, the connection cap) are set by `uvicorn_config` (qv/server/connections.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hmac
import logging
import logging.config
import os
import signal
import threading

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette._utils import get_route_path
from starlette.routing import Route

from qv.config import ConfigError, EngineConfig
from qv.errors import StartupError
from qv.server import (anthropic, completions, lora, openapi, ops, openai, playground, responses, responses_store,
                       sagemaker, systemone)
from qv.server.http_edges import LazyCORS, MeasureHTTP, body_limit, needs_key
from qv.server.errors import SHUTDOWN_MESSAGE, APIError, api_error_response, error_response, internal_error
from qv.server.log_setup import log_config
from qv.server.stats_log import log_stats
from qv.server.state import ServerState
from qv.server.streaming import ClientDisconnected

log = logging.getLogger("qv.server")


class BodyTooLarge(Exception):
    def __init__(self, limit: int, lever: str):
        super().__init__(f"the request body is larger than {limit} bytes ({lever})")


class BodyReadTimeout(Exception):
    pass


async def _answer(handler, state: ServerState, request: Request) -> Response:
    """The handler's response, or the JSON error its exception stands for. Exceptions end here, in
    the frame that raised them or the next, so no task keeps one (a task holding its exception would
    keep alive the frames of its traceback, and with them the request's body, until the cycle
    collector ran)."""
    try:
        return await handler(state, request)
    except APIError as exc:
        return api_error_response(exc)
    except BodyTooLarge as exc:  # no Connection: close: closing with the body unread would reset the connection,
        return error_response(413, str(exc))  # and the client could lose this answer; uvicorn drains the rest
    except BodyReadTimeout:
        return error_response(408, "the request body did not arrive whole within body_read_timeout_s",
                              headers={"Connection": "close"})
    except (ClientDisconnected, ClientDisconnect):
        return Response(status_code=499)  # nobody is listening; the request was aborted
    except Exception as exc:  # noqa: BLE001 - a bug: log it, answer 500 without its text, keep serving
        return api_error_response(internal_error(f"internal error in {request.url.path}", exc=exc))


def _endpoint(handler):
    """Route adapter: hands the handler the ServerState and turns errors into JSON responses. The
    handler runs as a task of its own, so that the end of the shutdown grace can stop it and still
    answer the client (JSON 503) instead of leaving it to uvicorn's cancellation (plain-text 500)."""
    async def endpoint(request: Request) -> Response:
        state: ServerState = request.app.state.qv
        if state.draining and request.url.path != "/metrics":
            return api_error_response(APIError(503, SHUTDOWN_MESSAGE, headers={"Retry-After": "1",
                                                                                "Connection": "close"}))
        work = asyncio.ensure_future(_answer(handler, state, request))
        stop = asyncio.ensure_future(state.stopping.wait())
        try:
            await asyncio.wait({work, stop}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            work.cancel()
            raise
        finally:
            stop.cancel()
        if work.done():
            return work.result()
        work.cancel()
        with contextlib.suppress(BaseException):
            await work
        return api_error_response(state.stopped_error())
    return endpoint


ROUTES = [
    ("/v1/chat/completions", openai.create_chat_completion, "POST"),
    ("/v1/completions", completions.create_completion, "POST"),
    ("/v1/responses", responses.create_response, "POST"),
    ("/v1/responses/{response_id}", responses_store.retrieve_response, "GET"),
    ("/v1/responses/{response_id}", responses_store.delete_response, "DELETE"),
    ("/v1/responses/{response_id}/cancel", responses_store.cancel_response, "POST"),
    ("/v1/responses/{response_id}/input_items", responses_store.list_input_items, "GET"),
    ("/v1/messages", anthropic.create_message, "POST"),
    ("/v1/messages/count_tokens", anthropic.count_tokens, "POST"),
    ("/v1/systemone", systemone.create_decision, "POST"),
    ("/v1/models", ops.list_models, "GET"),
    ("/v1/models/{model:path}", ops.retrieve_model, "GET"),  # `path`: served names may hold a `/`
    ("/health", ops.health, "GET"),
    ("/ping", ops.ping, "GET"),  # SageMaker's health check, GET and POST
    ("/ping", ops.ping, "POST"),
    ("/invocations", sagemaker.invocations, "POST"),
    ("/version", ops.version, "GET"),
    ("/metrics", ops.metrics, "GET"),
    ("/tokenize", ops.tokenize, "POST"),
    ("/detokenize", ops.detokenize, "POST"),
    ("/reset_prefix_cache", ops.reset_prefix_cache, "POST"),
    ("/openapi.json", openapi.schema, "GET"),
    ("/docs", openapi.docs, "GET"),
    *lora.ROUTES,  # /v1/load_lora_adapter, /v1/unload_lora_adapter
    ("/docs/{name}", openapi.docs_asset, "GET"),  # Swagger UI's script and stylesheet, from the package
    ("/", playground.index, "GET"),
    ("/playground", playground.page, "GET"),
    ("/static/{name}", playground.static_file, "GET"),
    ("/server_info", playground.info, "GET"),
]


class Guards:
    """Auth, body-size limit and body-read timeout, before routing (so a 401/413 costs no JSON
    parsing); a failure that escapes the app still gets a JSON 500."""

    def __init__(self, app, cfg_ref: dict):
        self.app = app
        self.cfg_ref = cfg_ref

    async def __call__(self, scope, receive, send):
        cfg: EngineConfig | None = self.cfg_ref.get("cfg")
        if scope["type"] != "http" or cfg is None:
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        path = get_route_path(scope) or "/"  # without root_path: the routes and the key's scope see the same path
        ambiguous = _ambiguous_headers(scope["headers"])
        if ambiguous:
            return await error_response(400, ambiguous, headers={"Connection": "close"})(scope, receive, send)
        if cfg.api_key and needs_key(path, cfg.api_key_scope, cfg.metrics_public) and scope["method"] != "OPTIONS":
            given = headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {cfg.api_key}".encode()):
                return await error_response(401, "Unauthorized: send `Authorization: Bearer <api key>`",
                                            headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
        limit, lever = body_limit(path, cfg)
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:  # refused unread (uvicorn discards the body as it comes)
            return await error_response(413, str(BodyTooLarge(limit, lever)))(scope, receive, send)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + cfg.body_read_timeout_s
        seen, body_done, started = 0, False, False

        async def guarded_receive():
            nonlocal seen, body_done
            if body_done:  # past the body only http.disconnect comes, whenever it does
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise BodyReadTimeout() from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:  # refused as it arrives: the rest is never read
                    raise BodyTooLarge(limit, lever)
                body_done = not message.get("more_body", False)
            return message

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            return await self.app(scope, guarded_receive, tracked_send)
        except Exception as exc:  # noqa: BLE001 - outside any route (middleware, routing): still JSON
            if started:
                raise
            await api_error_response(internal_error(f"internal error serving {path}", exc=exc))(scope, receive, send)


def _ambiguous_headers(raw: list[tuple[bytes, bytes]]) -> str | None:
    """Why a request's headers could be read two ways (RFC 9112 6.3: a proxy in front may pick the
    other reading), or None: Authorization twice, or Content-Length with Transfer-Encoding."""
    names = [k.lower() for k, _ in raw]
    if names.count(b"authorization") > 1:
        return "the request has more than one Authorization header"
    if b"content-length" in names and b"transfer-encoding" in names:
        return "the request has both Content-Length and Transfer-Encoding headers"
    return None


async def _http_error(request: Request, exc: HTTPException) -> Response:
    if exc.status_code == 404:
        return error_response(404, f"no route {request.method} {request.url.path}")
    if exc.status_code == 405:
        return error_response(405, f"method {request.method} is not allowed on {request.url.path}")
    return error_response(exc.status_code, str(exc.detail))


def _drain_on_signals(state: ServerState):
    """Chain SIGTERM and SIGINT to begin the drain; the server's own handler (uvicorn's, which closes
    the listener and waits for the connections open) gets the first signal only once nothing is in
    flight or the grace is nearly over, so that meanwhile new requests (and /health) get a 503
    rather than a refused connection. A later signal (SIGTERM then Ctrl+C) changes nothing: uvicorn
    would take a second one as "cut every connection now", without the streams' error event and
    [DONE]. A timer ends the process when the grace is over whatever still runs (the engine's own
    shutdown included). Only in the main thread, and only over a handler that can be chained (under
    uvicorn, always). Returns the function that puts the handlers back once the app has shut down."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    loop = asyncio.get_running_loop()
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    timer = threading.Timer(state.shutdown_grace_s, _exit_now, args=(state.shutdown_grace_s,))
    timer.daemon = True

    async def hand_over(sig, frame):
        while state.in_flight and not state.stopping.is_set():
            await asyncio.sleep(0.05)
        previous[sig](sig, frame)

    def start_drain(sig, frame):
        if not state.draining:  # a second signal before the first was handled
            state.begin_drain()
            timer.start()
            asyncio.ensure_future(hand_over(sig, frame))

    def on_signal(sig, frame):
        if state.draining:
            log.info("signal %d while draining: the drain goes on (it ends within shutdown_grace_s)", sig)
            return
        loop.call_soon_threadsafe(start_drain, sig, frame)

    installed = [sig for sig, handler in previous.items() if callable(handler)]
    for sig in installed:
        signal.signal(sig, on_signal)

    def restore():  # the app has shut down: nothing left for the timer to end
        timer.cancel()
        for sig in installed:
            if signal.getsignal(sig) is on_signal:
                signal.signal(sig, previous[sig])
    return restore


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def _heap_returns_large_buffers() -> None:
    """Allocations of 1 MiB and more (request bodies, prompts and their copies) are mapped from the
    OS and given back when freed. Left to itself, glibc raises that threshold to the size of the
    first large block freed, so later bodies come from the heap, which keeps what they took
    (tests/server/test_hardening.py measures the RSS). Nothing happens without glibc's mallopt."""
    try:
        ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, 1 << 20)
    except (OSError, AttributeError):
        pass


def _exit_now(grace: float) -> None:
    log.error("still running %.1f s after the shutdown signal (shutdown_grace_s): exiting now", grace)
    logging.shutdown()
    os._exit(1)


def build_app(cfg: EngineConfig | None = None, engine=None) -> Starlette:
    """A Starlette app whose lifespan builds the engine from `cfg` (or the environment), unless given
    one built from `cfg` already (`serve`)."""
    cfg_ref: dict = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        from qv.engine.async_engine import AsyncLLMEngine

        _heap_returns_large_buffers()
        config = cfg if cfg is not None else EngineConfig.from_env()
        running = engine if engine is not None else AsyncLLMEngine(config)
        state = app.state.qv = ServerState(running, config)
        app.state.qv_config = config  # /server_info shows the levers
        cfg_ref["cfg"] = config
        restore = _drain_on_signals(state)
        log.info("qv server ready: model %s (%s), max_model_len %d", state.model_name, state.model_root,
                 running.max_model_len)
        stats = None
        if config.log_stats:
            stats = asyncio.ensure_future(log_stats(running.stats, config.log_stats_interval_s))
        try:
            yield
        finally:
            if stats is not None:
                stats.cancel()
            state.close()
            await asyncio.to_thread(running.shutdown)
            restore()

    routes = [Route(path, _endpoint(fn), methods=[method], name=fn.__name__) for path, fn, method in ROUTES]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _http_error})
    app.add_middleware(Guards, cfg_ref=cfg_ref)
    app.add_middleware(anthropic.AnthropicEdge)  # outside the guards: x-api-key, Anthropic's error shape
    app.add_middleware(LazyCORS, cfg_ref=cfg_ref)  # outside the guard: a 401 carries CORS headers too
    app.add_middleware(MeasureHTTP)
    return app


app = build_app()


def start_hint(name: str, url: str, random_weights: bool) -> str:
    """What `qv serve` prints once it listens: where, the API docs, one request to try, and whether the
    weights are random (the embedded model's, or --load-format random) so its text is noise."""
    lines = [f"qv: serving model '{name}' at {url}/v1 (health: {url}/health)", f"qv: playground: {url}/",
             f"qv: API docs: {url}/docs",
             f"qv: try: curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' -d "
             f"'{{\"model\": \"{name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}], "
             f"\"max_tokens\": 32}}'"]
    if random_weights:
        lines.append("qv: the model has random weights (the embedded tiny model or --load-format random): "
                     "its answers are noise; serve a checkpoint folder for real text")
    return "\n".join(lines)


async def _serve(server, state_app: Starlette, cfg: EngineConfig) -> None:
    task = asyncio.ensure_future(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        host, port = server.servers[0].sockets[0].getsockname()[:2]
        host = f"[{host}]" if ":" in host else host
        random_weights = cfg.model is None or cfg.load_format == "random"
        print(start_hint(state_app.state.qv.model_name, f"http://{host}:{port}", random_weights), flush=True)
    await task
    if not server.started:
        raise SystemExit("qv: the server did not start (see the error above)")


def serve(cfg: EngineConfig) -> None:
    """`qv serve`: build the engine, run uvicorn on cfg.host:cfg.port and print where it listens once it
    does. An engine that cannot start exits the process with its message (SystemExit, status 1)."""
    import uvicorn

    from qv.engine.async_engine import AsyncLLMEngine

    logging.config.dictConfig(log_config(cfg.log_level, cfg.access_log))  # before the engine logs its start
    try:
        engine = AsyncLLMEngine(cfg)  # here, not in the lifespan: uvicorn would bury the message in a traceback
    except (StartupError, ConfigError) as exc:
        raise SystemExit(f"qv: the engine did not start: {exc}") from None
    application = build_app(cfg, engine)
    server = uvicorn.Server(uvicorn_config(application, cfg, host=cfg.host, port=cfg.port, log_level=cfg.log_level,
                                           log_config=log_config(cfg.log_level, cfg.access_log),
                                           access_log=cfg.access_log != "off"))
    asyncio.run(_serve(server, application, cfg))


def uvicorn_config(application, cfg: EngineConfig, **kw):
    """uvicorn's Config for `application` under cfg's connection levers: h11 (whose parser refuses
    what httptools lets through), the header-read timeout and connection cap (HardenedH11Protocol),
    the keep-alive timeout, 503 past max_connections requests (limit_concurrency), the shutdown grace."""
    import uvicorn

    from qv.server.connections import hardened_protocol

    return uvicorn.Config(application, http=hardened_protocol(cfg.header_read_timeout_s, cfg.max_connections),
                          lifespan="on", timeout_keep_alive=cfg.keep_alive_timeout_s,
                          limit_concurrency=cfg.max_connections, timeout_graceful_shutdown=cfg.shutdown_grace_s,
                          root_path=cfg.root_path, **kw)


__all__ = ["app", "build_app", "serve", "uvicorn_config"]
