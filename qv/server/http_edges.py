"""What sits around the routes for vLLM's users: which paths the API key guards (vLLM's scope),
CORS through Starlette's middleware under vLLM's flags, and the timing of every HTTP request for
the HTTP metrics (metrics.HTTPMetrics).

vLLM's --api-key guards the paths under /v1 only, so load-balancer probes and Prometheus scrapes
keep working; qv guards its two other routes that run or change the engine too (/invocations,
/reset_prefix_cache). `api_key_scope=all` guards every route but the health probes.
"""

from __future__ import annotations

import time

from starlette.middleware.cors import CORSMiddleware
from starlette.routing import Match

from qv.config import EngineConfig, string_list

HEALTH_PROBES = ("/health", "/ping")
PLAYGROUND_PAGES = ("/", "/playground")  # no data in them: the page asks for the key, then sends it
# they run or change the engine, or show its levers
GUARDED_OUTSIDE_V1 = ("/invocations", "/reset_prefix_cache", "/server_info")


def body_limit(path: str, cfg: EngineConfig) -> tuple[int, str]:
    """The largest body `path` takes and the lever that sets it: a Clef record's text and images fit in
    far fewer bytes than a chat's (clef_max_body_bytes), so /v1/systemone has its own, smaller cap."""
    if path == "/v1/systemone" and cfg.clef_max_body_bytes < cfg.max_body_bytes:
        return cfg.clef_max_body_bytes, "clef_max_body_bytes"
    return cfg.max_body_bytes, "max_body_bytes"


def needs_key(path: str, scope: str, metrics_public: bool) -> bool:
    """Whether a request to `path` must carry the API key (when one is set) under api_key_scope."""
    if path in HEALTH_PROBES or path in PLAYGROUND_PAGES or path.startswith("/static/"):
        return False
    if scope == "all":
        return not (path == "/metrics" and metrics_public)
    return path.startswith("/v1") or path in GUARDED_OUTSIDE_V1


class LazyCORS:
    """Starlette's CORSMiddleware under cfg's allowed_* levers, built once the config is known (the
    lifespan resolves it when the app is made without one). No origins: no CORS at all."""

    def __init__(self, app, cfg_ref: dict):
        self.app, self.cfg_ref, self.cors = app, cfg_ref, None

    async def __call__(self, scope, receive, send):
        cfg: EngineConfig | None = self.cfg_ref.get("cfg")
        if scope["type"] != "http" or cfg is None:
            return await self.app(scope, receive, send)
        if self.cors is None:
            origins = string_list(cfg.allowed_origins)
            self.cors = self.app if not origins else CORSMiddleware(
                self.app, allow_origins=origins, allow_methods=string_list(cfg.allowed_methods),
                allow_headers=string_list(cfg.allowed_headers), allow_credentials=cfg.allow_credentials)
        return await self.cors(scope, receive, send)


def _handler(app, scope) -> str:
    for route in getattr(app, "routes", ()):
        match, _ = route.matches(scope)
        if match is not Match.NONE:
            return route.path
    return "none"


class MeasureHTTP:
    """Times each HTTP request from its arrival to its response's last byte (a stream's too) and
    counts it, whatever answered it (a route, the guard's 401/413, CORS)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        state = getattr(getattr(scope.get("app"), "state", None), "qv", None)
        if scope["type"] != "http" or state is None:
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), 500

        async def counted_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counted_send)
        finally:
            state.metrics.http.observe(_handler(scope["app"], scope), scope["method"], status,
                                       time.perf_counter() - start)
