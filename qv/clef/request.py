"""Validation of a `POST /v1/systemone` body and its limits, then encoding.

Every refusal is a ClefRequestError (a 400: the server maps InvalidRequestError to 400) whose
message names the field and the limit, with the counts where there are counts. The limits are
the original stack's: 64 questions, 256 options in a question, 448 options in all, 16 images,
records up to the server's token cap (QV_CLEF_NMAX), Clef's default max_length 16,384.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

from qv.clef.encode import (DEFAULT_MAX_LENGTH, QUESTION_TYPES, EncodedRecord, SchemaTooLong, Tokenize,
                            batch_tokenizer, encode_record, media_text)
from qv.errors import InvalidRequestError

MAX_QUESTIONS = 64
MAX_OPTIONS_PER_QUESTION = 256
MAX_OPTIONS_TOTAL = 448
MAX_IMAGES = 16
TOP_LEVEL_FIELDS = ("model", "state", "questions", "images", "videos", "max_length")
QUESTION_FIELDS = ("type", "instructions", "criteria")


class ClefRequestError(InvalidRequestError):
    """A systemone body qv refuses (HTTP 400). `param` is the offending field's path."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class _Object(dict):
    """A JSON object that remembers keys the body gave more than once (json keeps the last)."""

    duplicate_keys: tuple[str, ...] = ()


def _pairs(pairs: list[tuple[str, Any]]) -> _Object:
    obj = _Object(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        dups = []
        for key, _ in pairs:
            if key in seen:
                dups.append(key)
            seen.add(key)
        obj.duplicate_keys = tuple(dups)
    return obj


def parse_body(raw: bytes | str) -> dict[str, Any]:
    """JSON body -> dict, keeping track of duplicate keys so that a duplicated question or option
    id is refused instead of silently dropped."""
    try:
        body = json.loads(raw, object_pairs_hook=_pairs)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ClefRequestError(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ClefRequestError(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def _kind(value: Any) -> str:
    """The JSON name of a value's type, for messages."""
    if value is None:
        return "null"
    for t, name in ((bool, "boolean"), (dict, "object"), (list, "array"), (str, "string"), ((int, float), "number")):
        if isinstance(value, t):
            return name
    return type(value).__name__


def _check_duplicates(obj: Any, what: str, param: str) -> None:
    dups = getattr(obj, "duplicate_keys", ())
    if dups:
        raise ClefRequestError(f"{what} {', '.join(repr(d) for d in dups)} given more than once", param)


def _check_question(qid: str, question: Any) -> int:
    """Validate one question; returns its number of options."""
    param = f"questions.{qid}"
    if qid == "":
        raise ClefRequestError("question ids must be non-empty strings", "questions")
    if not isinstance(question, dict):
        raise ClefRequestError(f"question {qid!r} must be an object, got {_kind(question)}", param)
    unknown = [k for k in question if k not in QUESTION_FIELDS]
    if unknown:
        raise ClefRequestError(f"question {qid!r}: unknown field(s) {', '.join(map(repr, unknown))}; "
                               f"allowed: {', '.join(QUESTION_FIELDS)}", param)
    kind = question.get("type")
    if not isinstance(kind, str) or kind not in QUESTION_TYPES:
        raise ClefRequestError(f"question {qid!r}: unknown type {kind!r}; supported: noul, choice, score",
                               param + ".type")
    criteria = question.get("criteria")
    cparam = param + ".criteria"
    if kind == "noul":
        if criteria is None:
            return 2
        if not isinstance(criteria, dict):
            raise ClefRequestError(f"question {qid!r}: noul criteria must be an object with keys 'true'/'false', "
                                   f"got {_kind(criteria)}", cparam)
        _check_duplicates(criteria, f"question {qid!r}: noul criteria key(s)", cparam)
        extra = [k for k in criteria if k not in ("true", "false")]
        if extra:
            raise ClefRequestError(f"question {qid!r}: noul criteria keys must be 'true' and/or 'false', "
                                   f"got {', '.join(map(repr, extra))}", cparam)
        return 2
    if not criteria:
        raise ClefRequestError(f"question {qid!r}: a {kind} question needs non-empty criteria", cparam)
    if kind == "choice":
        if not isinstance(criteria, dict):
            raise ClefRequestError(f"question {qid!r}: choice criteria must be an object mapping option id to "
                                   f"description, got {_kind(criteria)}", cparam)
        _check_duplicates(criteria, f"question {qid!r}: duplicate option id(s)", cparam)
        if any(str(k) == "" for k in criteria):
            raise ClefRequestError(f"question {qid!r}: option ids must be non-empty", cparam)
        if len({str(k) for k in criteria}) != len(criteria):
            raise ClefRequestError(f"question {qid!r}: duplicate option id(s)", cparam)
    elif not isinstance(criteria, list):
        raise ClefRequestError(f"question {qid!r}: score criteria must be an array of levels (lowest first), "
                               f"got {_kind(criteria)}", cparam)
    if len(criteria) > MAX_OPTIONS_PER_QUESTION:
        raise ClefRequestError(f"question {qid!r} has {len(criteria)} options; at most {MAX_OPTIONS_PER_QUESTION} "
                               "options per question", cparam)
    return len(criteria)


def validate_request(body: Any, served_models: Iterable[str] | None = None) -> None:
    """Refuse a body that breaks the contract or a limit (ClefRequestError); return if it is fine."""
    if not isinstance(body, dict):
        raise ClefRequestError(f"request body must be a JSON object, got {_kind(body)}")
    unknown = [k for k in body if k not in TOP_LEVEL_FIELDS]
    if unknown:
        raise ClefRequestError(f"unknown field(s) {', '.join(map(repr, unknown))}; allowed: "
                               f"{', '.join(TOP_LEVEL_FIELDS)}", unknown[0])
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ClefRequestError("'model' is required and must be a non-empty string", "model")
    if served_models is not None:
        served = list(served_models)
        if model not in served:
            raise ClefRequestError(f"model {model!r} is not served here; served: {', '.join(served)}", "model")
    if "state" not in body:
        raise ClefRequestError("'state' is required (a string or any JSON value)", "state")
    questions = body.get("questions")
    if not isinstance(questions, dict):
        raise ClefRequestError(f"'questions' must be an object mapping question id to question, got "
                               f"{_kind(questions)}", "questions")
    if not questions:
        raise ClefRequestError("'questions' is empty: at least one question is required", "questions")
    _check_duplicates(questions, "question id(s)", "questions")
    if len(questions) > MAX_QUESTIONS:
        raise ClefRequestError(f"{len(questions)} questions; at most {MAX_QUESTIONS} questions per record",
                               "questions")
    total = sum(_check_question(qid, q) for qid, q in questions.items())
    if total > MAX_OPTIONS_TOTAL:
        raise ClefRequestError(f"the questions have {total} options in total; at most {MAX_OPTIONS_TOTAL} "
                               "options per record", "questions")
    _check_media(body)
    _check_max_length(body.get("max_length"))


def _check_media(body: dict) -> None:
    images = body.get("images")
    if images is not None:
        if not isinstance(images, list):
            raise ClefRequestError(f"'images' must be an array, got {_kind(images)}", "images")
        if len(images) > MAX_IMAGES:
            raise ClefRequestError(f"{len(images)} images; at most {MAX_IMAGES} images per record", "images")
    videos = body.get("videos")
    if videos not in (None, []):
        raise ClefRequestError("videos are not supported for Clef records (Clef takes images only)", "videos")


def _check_max_length(value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ClefRequestError(f"'max_length' must be a positive integer, got {value!r}", "max_length")


def effective_max_length(requested: int | None, nmax: int, cap_name: str = "QV_CLEF_NMAX") -> int:
    """Clef's default (16,384) unless the request lowers it; never above the server cap."""
    if requested is None:
        return min(DEFAULT_MAX_LENGTH, nmax)
    if requested > nmax:
        raise ClefRequestError(f"max_length {requested} is over this server's Clef record cap of {nmax} tokens "
                               f"({cap_name})", "max_length")
    return requested


def encode_request(tokenizer: Any, body: Any, nmax: int, served_models: Iterable[str] | None = None,
                   tokenize: Tokenize | None = None, cap_name: str = "QV_CLEF_NMAX", images: Sequence = (),
                   multimodal: Any = None) -> EncodedRecord:
    """Validate and encode a systemone body: the record the engine will run. `nmax` is the
    server's record cap and `cap_name` what sets it (named in the messages).

    A body with images needs them preprocessed, in body order (`images`: VisionItems from the
    checkpoint's processor), and `multimodal`, the engine's prompt builder
    (qv.engine.multimodal.MultimodalInputs); the record then carries its MultimodalPrompt."""
    validate_request(body, served_models)
    n_images = len(body.get("images") or ())
    if n_images and multimodal is None:
        raise ClefRequestError("this model takes no images (it has no vision tower): send the record without "
                               "'images'", "images")
    if n_images != len(images):
        raise ClefRequestError(f"the record lists {n_images} images but {len(images)} were given", "images")
    tokenize = tokenize or batch_tokenizer(tokenizer)
    placeholders = tokenize([media_text(n_images)])[0] if n_images else []
    media_ids = multimodal.prompt(placeholders, images).token_ids if n_images else None
    max_length = effective_max_length(body.get("max_length"), nmax, cap_name)
    try:
        record = encode_record(tokenizer, body, max_length=max_length, tokenize=tokenize, media_ids=media_ids)
    except SchemaTooLong as e:
        limit = "max_length" if max_length < nmax else f"Clef record cap ({cap_name})"
        images_part = f", {e.media} the images" if e.media else ""
        raise ClefRequestError(f"record too long: the template, images and questions take {e.fixed} tokens before "
                               f"any state ({e.schema} of them the schema{images_part}), more than the "
                               f"{e.max_length}-token {limit}", "images" if e.media > e.schema else "questions") from None
    if record.num_tokens > nmax:  # cannot happen (max_length <= nmax); a guard, as the engine relies on it
        raise ClefRequestError(f"record has {record.num_tokens} tokens, over the Clef record cap of {nmax} "
                               f"({cap_name})", "state")
    if n_images:  # the engine's view of the images: the prompt with its placeholders, expanded again
        ids, a, b = list(record.input_ids), record.media_offset, record.media_offset + record.media_tokens
        mp = multimodal.prompt(ids[:a] + placeholders + ids[b:], images)
        if mp.token_ids != ids:
            raise AssertionError("the record's image tokens differ from its multimodal prompt's")
        record = replace(record, multimodal=mp)
    return record
