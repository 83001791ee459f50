"""Error bodies and status codes, vLLM's shape: {"error": {"message", "type", "param", "code"}}.

Anything a client sent wrongly is a 4xx with a message that names the field; a 500 means qv (or
the engine) failed, never the request. pydantic's 422 becomes 400, as in vLLM. A 5xx never carries
the text of an internal exception: that goes to the log under a request id, and the client gets
the id (`internal_error`).
"""

from __future__ import annotations

import json
import logging
import uuid
from http import HTTPStatus

from pydantic import ValidationError
from starlette.responses import JSONResponse

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestEntityTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}

log = logging.getLogger("qv.server")

SHUTDOWN_MESSAGE = "The server is shutting down and takes no new requests; please retry on another instance."
STOPPED_MESSAGE = ("The server is shutting down: this request was stopped before it finished (shutdown_grace_s "
                   "ran out); please retry on another instance.")
BUSY_MESSAGE = ("The engine is currently busy and cannot accept new requests. Please try again later or on a "
                "different instance.")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def internal_error(what: str, request_id: str | None = None, exc: BaseException | None = None,
                   detail: str | None = None) -> APIError:
    """A 500 whose body says what failed and gives a request id; the exception (or the engine's
    `detail`) is logged under that id, never sent."""
    rid = request_id or f"req-{uuid.uuid4().hex}"
    if exc is not None:
        log.error("%s (request %s)", what, rid, exc_info=(type(exc), exc, exc.__traceback__))
    else:
        log.error("%s (request %s): %s", what, rid, detail)
    return APIError(500, f"{what} (request id {rid}; the server log has the details)",
                    headers={"x-request-id": rid})


def error_body(status: int, message: str, param: str | None = None) -> dict:
    err_type = ERROR_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def api_error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "json-or-python"}


def _loc(loc: tuple) -> str:
    """pydantic location -> `messages[0].content` style path, without union-branch tags."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif str(part) in _TYPE_TAGS or any(c in str(part) for c in "[-"):
            continue  # a union branch such as `str` or `list[int]` says nothing to a client
        else:
            out += ("." if out else "") + str(part)
    return out


def validation_error(exc: ValidationError) -> APIError:
    """pydantic errors -> one 400 that names each bad field (vLLM: "N validation error(s): ...").
    The branches of a union that all failed are reported once per field, joined by "or"."""
    by_loc: dict[str, list[str]] = {}
    for e in exc.errors(include_url=False, include_input=False):
        msg = e.get("msg", "invalid value")
        if msg.startswith("Value error, "):  # our own validators: the message says it all
            msg = msg[len("Value error, "):]
        msgs = by_loc.setdefault(_loc(tuple(e.get("loc", ()))), [])
        if msg not in msgs:
            msgs.append(msg)
    parts = [f"{where}: {' or '.join(msgs)}" if where else " or ".join(msgs) for where, msgs in by_loc.items()]
    n = len(parts)
    message = f"{n} validation error{'s' if n != 1 else ''}: " + "; ".join(parts[:8])
    if n > 8:
        message += f" (and {n - 8} more)"
    return APIError(400, message, next(iter(by_loc), None) or None)


def sse_error(exc: APIError) -> bytes:
    """An error after a stream started: one `data: {"error": ...}` event (then the caller sends [DONE])."""
    return b"data: " + json.dumps(exc.body(), ensure_ascii=False).encode() + b"\n\n"
