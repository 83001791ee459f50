"""POST /v1/systemone: Clef decisions on the served weights (research/serving.md part A).

`{model, state, questions, images?, videos?, max_length?}` -> `{model, answers, usage}` exactly as
Clef's `systemone()` answers (qv/clef/answers.py). Bodies may be zstd-compressed
(`Content-Encoding: zstd`, as the TypeSafe SDK sends them). Every refusal is a 400 whose message
names the field and the limit (qv/clef/request.py: question/option/image counts, types, criteria,
duplicate or empty ids, unknown fields, the model name, the record cap with its token counts);
images are refused until the vision encoder serves Clef records (`qv.clef.request._check_media`,
the one place that decides), videos always.

The endpoint encodes the record; the engine runs it as one prefill-only request and checks that
what ran is what was encoded (length + checksum) before answering (qv/engine/clef_rows.py).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from qv.clef.answers import response
from qv.clef.request import ClefRequestError, encode_request, parse_body
from qv.engine.request import InvalidRequestError
from qv.server.errors import APIError, bad_request
from qv.server.state import ServerState, random_id
from qv.server.streaming import read_body, until_disconnect

NOT_SERVED = ("this server does not serve Clef decisions: the model folder has no Clef head "
              "(joint_head.safetensors, or clef/ with the head and adapters) or QV_CLEF is off")


def encode(state: ServerState, raw: bytes):
    """Validate and encode a body (400 with the message of the limit it breaks)."""
    cap = state.engine.clef_cap
    if cap is None:
        raise bad_request(NOT_SERVED)
    nmax, cap_name = cap
    try:
        body = parse_body(raw)
        return body, encode_request(state.tokenizer, body, nmax, state.served_names, cap_name=cap_name)
    except ClefRequestError as exc:
        raise bad_request(str(exc), exc.param) from None


async def create_decision(state: ServerState, request: Request) -> Response:
    body, record = encode(state, await read_body(request, state.max_body_bytes))
    state.check_capacity()
    state.in_flight += 1
    try:
        result = await until_disconnect(request, state.engine.decide(
            random_id("clef"), record, record.num_tokens, record.checksum))
    except InvalidRequestError as exc:
        raise bad_request(str(exc)) from None
    except RuntimeError as exc:
        raise APIError(500, str(exc)) from None
    finally:
        state.in_flight -= 1
    return JSONResponse(response(body["model"], record, result.probabilities))
