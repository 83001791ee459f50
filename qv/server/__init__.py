"""OpenAI-compatible HTTP server. `uvicorn qv.server:app` serves QV_MODEL (or the embedded tiny model).

`app` is resolved lazily so that importing `qv.server` (or its parsers) loads neither the ASGI
app nor torch; the model itself loads in the app's lifespan, when the server starts.
"""

from __future__ import annotations


def __getattr__(name: str):
    if name == "app":
        from qv.server.app import app

        return app
    raise AttributeError(f"module 'qv.server' has no attribute {name!r}")
