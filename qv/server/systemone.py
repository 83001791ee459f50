"""POST /v1/systemone: Clef decisions on the served weights (research/serving.md part A).

`{model, state, questions, images?, videos?, max_length?}` -> `{model, answers, usage}` exactly as
Clef's `systemone()` answers (qv/clef/answers.py). Bodies may be zstd-compressed
(`Content-Encoding: zstd`, as the TypeSafe SDK sends them). Every refusal is a 400 whose message
names the field and the limit (qv/clef/request.py: question/option/image counts, types, criteria,
duplicate or empty ids, unknown fields, the model name, the record cap with its token counts).
`images` (at most 16) are http(s) URLs, data URLs or bare base64, fetched like chat's image_url
parts (qv/server/media.py, the media_* levers) and placed after "STATE:" as Clef does;
videos are always refused (Clef takes none).

The endpoint encodes the record; the engine runs it as one prefill-only request and checks that
what ran is what was encoded (length + checksum) before answering (qv/engine/clef_rows.py).
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from qv.clef.answers import response
from qv.clef.request import ClefRequestError, encode_request, parse_body, validate_request
from qv.engine.request import InvalidRequestError
from qv.server.errors import bad_request
from qv.server.state import ServerState, random_id
from qv.server.streaming import read_body, until_disconnect

NOT_SERVED = ("this server does not serve Clef decisions: the model folder has no Clef head "
              "(joint_head.safetensors, or clef/ with the head and adapters) or QV_CLEF is off")


async def encode(state: ServerState, raw: bytes):
    """Validate and encode a body, fetching and preprocessing its images (400 with the message of
    the limit it breaks; image failures name the entry, e.g. `images[2]`)."""
    cap = state.engine.clef_cap
    if cap is None:
        raise bad_request(NOT_SERVED)
    nmax, cap_name = cap
    try:
        body = parse_body(raw)
        validate_request(body, state.served_names)
        items = await fetch_images(state, body.get("images") or [])
        record = await asyncio.to_thread(encode_request, state.tokenizer, body, nmax, state.served_names,
                                         cap_name=cap_name, images=items, multimodal=state.media.inputs)
    except ClefRequestError as exc:
        raise bad_request(str(exc), exc.param) from None
    except InvalidRequestError as exc:
        raise bad_request(str(exc), "images") from None
    return body, record


async def fetch_images(state: ServerState, images: list) -> list:
    """The body's images as VisionItems, in order: each an http(s) URL, a data URL or bare base64,
    fetched under the media_* levers like chat's image_url parts."""
    if not images:
        return []
    if state.media.inputs is None:
        raise bad_request("this model takes no images (it has no vision tower): send the record without 'images'",
                          "images")
    if len(images) > state.media.max_images:
        raise bad_request(f"{len(images)} images; this server takes at most {state.media.max_images} images per "
                          "request (media_max_images)", "images")
    for i, url in enumerate(images):
        if not isinstance(url, str) or not url:
            raise bad_request(f"images[{i}] must be a non-empty string: an http(s) URL, a data URL or base64 data",
                              f"images[{i}]")
    return await state.media.items([("image", url, f"images[{i}]") for i, url in enumerate(images)], "images")


async def create_decision(state: ServerState, request: Request) -> Response:
    body, record = await encode(state, await read_body(request, state.max_body_bytes))
    state.check_capacity()
    with state.engine_call():
        result = await until_disconnect(request, state.engine.decide(
            random_id("clef"), record, record.num_tokens, record.checksum))
    return JSONResponse(response(body["model"], record, result.probabilities))
