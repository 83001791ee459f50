"""OpenAI-compatible HTTP server. `uvicorn qv.server:app` serves QV_MODEL (or the embedded tiny model).

`app` is resolved lazily so that importing `qv.server` (or its parsers) loads neither the ASGI
app nor torch; the model itself loads in the app's lifespan, when the server starts.
"""

from __future__ import annotations


def __getattr__(name: str):
    if name == "app":
        import importlib

        module = importlib.import_module("qv.server.app")

        # Importing the submodule `qv.server.app` binds that *module* as this package's `app`
        # attribute; rebind it to the ASGI app so every later `qv.server.app` lookup (uvicorn
        # looks more than once) finds the application. Use `from qv.server.app import ...` for
        # the module's other names.
        globals()["app"] = module.app
        return module.app
    raise AttributeError(f"module 'qv.server' has no attribute {name!r}")
