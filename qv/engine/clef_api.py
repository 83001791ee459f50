"""Clef decisions (POST /v1/systemone) as the server and the offline API call them: parse and
validate a body, encode it into the record the engine runs, format the engine's answer. The one
way into qv.clef from above the engine; refusals are ClefRequestError (an InvalidRequestError:
HTTP 400) naming the field and the limit."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from qv.clef.answers import response
from qv.clef.encode import EncodedRecord, render
from qv.clef.limits import MAX_IMAGES
from qv.clef.request import ClefRequestError, SystemOneRequest, decode_json, encode_request, validate
from qv.engine.request import TextBound

__all__ = ["CLEF_MODEL_NAMES", "MAX_IMAGES", "NOT_SERVED", "ClefRequestError", "Decision", "decision_response",
           "encode_decision", "parse_decision"]

# Clef answers to these beside the served names: the original stack's name, and the TypeSafe SDK's
# default model
CLEF_MODEL_NAMES = ("clef", "jev-latest")
NOT_SERVED = ("this server does not serve Clef decisions: the model folder has no Clef head "
              "(joint_head.safetensors, or clef/ with the head and adapters) or QV_CLEF is off")

Decision = SystemOneRequest


def parse_decision(body: bytes | str | Mapping, parts: Mapping[str, bytes] | None = None) -> Decision:
    """A systemone body (JSON text, or already decoded) and the parts of its multipart form, if it
    came as one (name -> bytes, the `request` part removed) -> the validated request."""
    if isinstance(body, (bytes, bytearray, str)):
        body = decode_json(body)
    return validate(body, parts)


def encode_decision(tokenizer: Any, decision: Decision, cap: tuple[int, str], images: Sequence = (),
                    multimodal: Any = None, text_bound: TextBound | None = None) -> EncodedRecord:
    """The record the engine runs (`AsyncLLMEngine.decide` / `LLMEngine.add_clef`). `cap`: the
    engine's record cap and what sets it (`clef_cap`); `images`: the decision's images
    (`decision.image_sources()`, in that order) preprocessed by `multimodal.processor`; `text_bound`:
    the tokenizer's TextBound (the server's): with it, a schema too long is refused by its size."""
    nmax, cap_name = cap
    bound = text_bound
    if bound is not None:  # bytes first: a schema too long for the cap is refused before any of it is tokenized
        chars = sum(len(render(q.instructions)) + len(render(q.criteria)) for q in decision.questions.values())
        floor = chars // (bound.max_token_bytes * bound.shrink)
        if floor > nmax:
            raise ClefRequestError(f"record too long: the questions' text ({chars} characters) makes at least {floor} "
                                   f"tokens, more than the {nmax}-token Clef record cap ({cap_name})", "questions")
    return encode_request(tokenizer, decision, nmax, cap_name=cap_name, images=images, multimodal=multimodal)


def decision_response(model: str, record: EncodedRecord, probabilities: list[list[float]]) -> dict:
    """The systemone response body of a finished record (ClefResult.probabilities)."""
    return response(model, record, probabilities)
