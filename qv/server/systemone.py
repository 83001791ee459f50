"""POST /v1/systemone: Clef decisions on the served weights (research/serving.md part A).

`{model, state, questions, images?, assets?, max_length?}` -> `{model, answers, usage}` exactly as
Clef's `systemone()` answers. `model` is a served name, `clef` or `jev-latest` (the TypeSafe SDK's
default); any other name is the usual 404. The body is JSON, or the TypeSafe SDK's multipart form
(a `request` part holding the JSON, then the `asset-N` parts its `assets` name); either may be
zstd-compressed (`Content-Encoding: zstd`). Validation, encoding and answers are qv.clef's (request.py,
answers.py): every refusal is a 400 whose message names the field and the limit.
Images (`images` entries and `assets`) are fetched and decoded like chat's image_url parts, under
the media_* levers (`load_images`); the engine runs the record as one prefill-only request and
checks that the tokens that ran hash as the encoded ones before answering.
"""

from __future__ import annotations

import asyncio

from python_multipart.multipart import MultipartParseError, MultipartParser, parse_options_header
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from qv.clef.answers import response as decision_response
from qv.clef.limits import MAX_IMAGES
from qv.clef.request import CLEF_MODEL_NAMES, ClefRequestError, SystemOneRequest, encode_request, validate
from qv.engine.request import InvalidRequestError
from qv.server.errors import bad_request
from qv.server.state import ServerState, random_id
from qv.server.streaming import read_body, until_disconnect

JSON, MULTIPART = "application/json", "multipart/form-data"
REQUEST_PART = "request"  # the multipart part that holds the JSON body (the TypeSafe SDK's name)
MAX_BOUNDARY = 70  # RFC 2046, section 5.1.1
NOT_SERVED = ("this server does not serve Clef decisions: the model folder has no Clef head "
              "(joint_head.safetensors, or clef/ with the head and adapters) or QV_CLEF is off")


async def create_decision(state: ServerState, request: Request) -> Response:
    cap = state.engine.clef_cap
    if cap is None:
        raise bad_request(NOT_SERVED)
    decision, parts = await read_decision(state, request)
    if decision.model not in CLEF_MODEL_NAMES:
        state.check_model(decision.model, adapters=False)  # Clef decisions run Clef's weights, never an adapter
    images = await load_images(state, decision.image_sources(parts))
    try:
        bound = state.text_bound
        record = await asyncio.to_thread(encode_request, state.tokenizer, decision, cap[0], cap_name=cap[1],
                                         images=images, multimodal=state.media.inputs,
                                         max_chars_per_token=bound.max_token_bytes * bound.shrink if bound else None)
    except ClefRequestError as exc:
        raise bad_request(str(exc), exc.param) from None
    except InvalidRequestError as exc:
        raise bad_request(str(exc), "images") from None
    seats = state.admit(1)  # a record waits for a Clef slot like a chat for a seat: it counts until it is answered
    try:
        with state.engine_call():
            result = await until_disconnect(request, state.engine.decide(random_id("clef"), record))
    finally:
        seats.release()
    return JSONResponse(decision_response(decision.model, record, result.probabilities))


async def read_decision(state: ServerState, request: Request) -> tuple[SystemOneRequest, dict[str, bytes]]:
    """The validated body and its multipart parts (name -> bytes; none for a JSON body). Parsing
    runs off the event loop: a body may be megabytes."""
    limit, lever = state.clef_body_limit
    raw = await read_body(request, limit, (JSON, MULTIPART), lever)
    parts: dict[str, bytes] = {}
    body: bytes | None = raw
    if request.headers.get("content-type", "").split(";", 1)[0].strip().lower() == MULTIPART:
        parts = await asyncio.to_thread(read_multipart, request.headers["content-type"], raw, MAX_IMAGES + 1)
        body = parts.pop(REQUEST_PART, None)
        if body is None:
            raise bad_request(f"a multipart systemone body needs a {REQUEST_PART!r} part holding the JSON request",
                              REQUEST_PART)
    try:
        return await asyncio.to_thread(validate, body, parts), parts
    except ClefRequestError as exc:
        raise bad_request(str(exc), exc.param) from None


class _PartError(Exception):
    pass


def read_multipart(content_type: str, body: bytes, max_parts: int) -> dict[str, bytes]:
    """A multipart/form-data body (RFC 7578) -> {part name: bytes}: at most `max_parts` parts, each
    named once, the body complete up to its closing boundary. 400 otherwise."""
    _, params = parse_options_header(content_type)
    boundary = params.get(b"boundary")
    if not boundary:
        raise bad_request("the multipart body's Content-Type has no boundary")
    if len(boundary) > MAX_BOUNDARY:
        raise bad_request(f"the multipart boundary is {len(boundary)} characters long; RFC 2046 allows at most "
                          f"{MAX_BOUNDARY}")
    parts: dict[str, bytearray] = {}
    header: list[bytes] = [b"", b""]  # the header line being read: name, value
    seen = {"disposition": b"", "current": bytearray(), "ended": False}

    def header_end() -> None:
        if header[0].strip().lower() == b"content-disposition":
            seen["disposition"] = header[1]
        header[0] = header[1] = b""

    def headers_done() -> None:
        _, options = parse_options_header(seen["disposition"])
        seen["disposition"] = b""
        name = options.get(b"name", b"").decode("utf-8", "replace")
        if not name:
            raise _PartError("a part has no name (Content-Disposition: form-data; name=...)")
        if name in parts:
            raise _PartError(f"part {name!r} is given more than once")
        if len(parts) >= max_parts:
            raise _PartError(f"more than {max_parts} parts (a 'request' part and at most {max_parts - 1} images)")
        parts[name] = seen["current"] = bytearray()

    callbacks = {
        "on_header_field": lambda data, start, end: header.__setitem__(0, header[0] + data[start:end]),
        "on_header_value": lambda data, start, end: header.__setitem__(1, header[1] + data[start:end]),
        "on_header_end": header_end,
        "on_headers_finished": headers_done,
        "on_part_data": lambda data, start, end: seen["current"].extend(data[start:end]),
        "on_end": lambda: seen.__setitem__("ended", True),
    }
    try:
        parser = MultipartParser(boundary, callbacks)
        parser.write(body)
        parser.finalize()
    except (MultipartParseError, _PartError) as exc:
        raise bad_request(f"the multipart body could not be read: {exc}") from None
    if not seen["ended"]:
        raise bad_request("the multipart body ends before its closing boundary")
    return {name: bytes(data) for name, data in parts.items()}


async def load_images(state: ServerState, sources: list[tuple[str | bytes, str]]) -> list:
    """The decision's images as VisionItems, in record order: URL strings (http(s), data URLs,
    base64) and multipart parts' bytes, fetched and preprocessed under the media_* levers. The
    one place that calls the media API."""
    if not sources:
        return []
    param = sources[0][1].split(".", 1)[0].split("[", 1)[0]
    if state.media.inputs is None:
        raise bad_request(f"this model takes no images ({state.media.off_reason}): send the record without "
                          "'images' or 'assets'", param)
    if len(sources) > state.media.max_images:
        raise bad_request(f"{len(sources)} images; this server takes at most {state.media.max_images} images per "
                          "request (media_max_images)", param)
    return await state.media.items([("image", src, where) for src, where in sources], param)
