"""A `POST /v1/systemone` body: its one validation (SystemOneRequest, a pydantic model) and its
encoding into the record the engine runs (`encode_request`).

Every refusal is a ClefRequestError (a 400: the server maps InvalidRequestError to 400) whose
message names the field and the limit, with the counts where there are counts; `param` is the
field's path. The limits are the original stack's (qv/clef/limits.py); records go up to the
server's token cap (QV_CLEF_NMAX), Clef's default max_length is 16,384. The body's JSON values
must be JSON: no NaN or Infinity, no lone UTF-16 surrogates, nested at most MAX_JSON_DEPTH deep.

Images, at most MAX_IMAGES in all, go after "STATE:" as Clef places them, in this order:
- `images`: each an http(s) URL, a data URL or bare base64, or chat's `{"image_url": {"url": ...}}`
  (also `{"type": "image_url", "image_url": "..."}`); offline, PIL images or arrays too;
- `assets`, the TypeSafe SDK's form: `{placeholder: {"type": "image", "part": "asset-0"}}` naming a
  part of a multipart body, or `{"data_base64": ...}`. Each placeholder found in a string of the
  state, an instruction or a criterion becomes "[image N]", N the image's place in the record.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from qv.clef.encode import (DEFAULT_MAX_LENGTH, QUESTION_TYPES, EncodedRecord, SchemaTooLong, Tokenize,
                            batch_tokenizer, encode_record, media_text, render)
from qv.clef.limits import (MAX_IMAGES, MAX_JSON_CONTAINERS, MAX_JSON_DEPTH, MAX_OPTIONS_PER_QUESTION,
                            MAX_OPTIONS_TOTAL, MAX_QUESTIONS)
from qv.errors import InvalidRequestError

__all__ = ["MAX_IMAGES", "MAX_OPTIONS_PER_QUESTION", "MAX_OPTIONS_TOTAL", "MAX_QUESTIONS", "ClefRequestError",
           "SystemOneRequest", "decode_json", "encode_request", "validate"]

TOP_LEVEL_FIELDS = ("model", "state", "questions", "images", "assets", "videos", "max_length")
QUESTION_FIELDS = ("type", "instructions", "criteria")
ASSET_FIELDS = ("type", "format", "data_base64", "part")


# the model names a decision may carry beside the served ones: the original stack's, and the TypeSafe
# SDK's default
CLEF_MODEL_NAMES = ("clef", "jev-latest")


class ClefRequestError(InvalidRequestError):
    """A systemone body qv refuses (HTTP 400). `param` is the offending field's path."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _fail(message: str, param: str | None = None) -> PydanticCustomError:
    return PydanticCustomError("clef", "{message}", {"message": message, "param": param})


def _kind(value: Any) -> str:
    """The JSON name of a value's type, for messages."""
    if value is None:
        return "null"
    for t, name in ((bool, "boolean"), (dict, "object"), (list, "array"), (str, "string"), ((int, float), "number")):
        if isinstance(value, t):
            return name
    return type(value).__name__


# ---- JSON ----------------------------------------------------------------------------------------
class _Object(dict):
    """A JSON object that remembers keys the body gave more than once (json keeps the last)."""

    duplicate_keys: tuple[str, ...] = ()


def _pairs(pairs: list[tuple[str, Any]]) -> _Object:
    obj = _Object(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        obj.duplicate_keys = tuple(k for k, _ in pairs if k in seen or seen.add(k))
    return obj


def decode_json(raw: bytes | str) -> Any:
    """JSON text -> Python values, keeping track of duplicate keys so that a duplicated question
    or option id is refused instead of silently dropped. A text with more than MAX_JSON_CONTAINERS
    opening brackets is refused before it is parsed (they are counted on the text, strings included:
    ten million empty objects would take seconds and gigabytes to parse)."""
    opens = raw.count(b"{") + raw.count(b"[") if isinstance(raw, (bytes, bytearray)) else raw.count("{") + raw.count("[")
    if opens > MAX_JSON_CONTAINERS:
        raise ClefRequestError(f"the request body holds {opens} '{{' and '[' characters; a record may hold at most "
                               f"{MAX_JSON_CONTAINERS} JSON objects and arrays (counted on the text, strings included)")
    try:
        return json.loads(raw, object_pairs_hook=_pairs)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ClefRequestError(f"request body is not valid JSON: {e}") from None


def _check_duplicates(obj: Any, what: str, param: str) -> None:
    dups = getattr(obj, "duplicate_keys", ())
    if dups:
        raise _fail(f"{what} {', '.join(repr(d) for d in dups)} given more than once", param)


def _join(where: str, key: Any) -> str:
    if isinstance(key, int):
        return f"{where}[{key}]"
    return f"{where}.{key}" if where else str(key)


def _check_string(s: str, where: str, key: Any) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:  # the path may hold the surrogate too: escaped, so the answer is valid JSON
        path = _join(where, key).encode("utf-8", "backslashreplace").decode("utf-8")
        raise _fail(f"{path}: a lone UTF-16 surrogate ({s[e.start]!r} at character {e.start}) is not text; "
                    "send valid Unicode", path) from None


def check_json_values(body: Mapping) -> None:
    """Refuse non-finite numbers, lone surrogates (keys too) and nesting past MAX_JSON_DEPTH, with
    the path of the value. Iterative, so a deep body cannot exhaust the stack; paths are made for
    containers and for the value that fails only."""
    stack: list[tuple[Any, str, int]] = [(body, "", 0)]
    walked = 0
    while stack:
        node, where, depth = stack.pop()
        walked += 1
        if walked > MAX_JSON_CONTAINERS:  # a body given as Python values (the offline API) has not been counted
            raise _fail(f"more than {MAX_JSON_CONTAINERS} JSON objects and arrays in the record", "state")
        if depth > MAX_JSON_DEPTH:
            top = re.split(r"[.\[]", where, maxsplit=1)[0]
            raise _fail(f"{top}: JSON nested deeper than {MAX_JSON_DEPTH} levels", top)
        for key, value in (node.items() if isinstance(node, dict) else enumerate(node)):
            if isinstance(key, str) and not key.isascii():
                _check_string(key, where, key)
            if isinstance(value, str):
                if not value.isascii():
                    _check_string(value, where, key)
            elif isinstance(value, float):
                if not math.isfinite(value):
                    path = _join(where, key)
                    name = "NaN" if value != value else "Infinity" if value > 0 else "-Infinity"
                    raise _fail(f"{path}: {name} is not a number JSON allows; numbers must be finite", path)
            elif isinstance(value, (dict, list, tuple)):
                stack.append((value, _join(where, key), depth + 1))


# ---- the model -----------------------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, frozen=True)


def _object_with(data: Any, fields: tuple[str, ...]) -> Any:
    if not isinstance(data, dict):
        raise _fail(f"must be an object, got {_kind(data)}")
    unknown = [k for k in data if k not in fields]
    if unknown:
        raise _fail(f"unknown field(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(fields)}")
    return data


class Question(_Strict):
    type: str = Field(None, validate_default=True)
    instructions: Any = None
    criteria: Any = Field(None, validate_default=True)

    @model_validator(mode="before")
    @classmethod
    def _shape(cls, data: Any) -> Any:
        return _object_with(data, QUESTION_FIELDS)

    @field_validator("type", mode="before")
    @classmethod
    def _type(cls, kind: Any) -> str:
        if not isinstance(kind, str) or kind not in QUESTION_TYPES:
            raise _fail(f"unknown type {kind!r}; supported: noul, choice, score")
        return kind

    @field_validator("criteria", mode="before")
    @classmethod
    def _criteria(cls, criteria: Any, info: ValidationInfo) -> Any:
        kind = info.data.get("type")
        if kind == "noul":
            if criteria is None:
                return None
            if not isinstance(criteria, dict):
                raise _fail(f"noul criteria must be an object with keys 'true'/'false', got {_kind(criteria)}")
            _check_duplicates(criteria, "noul criteria key(s)", None)
            extra = [k for k in criteria if k not in ("true", "false")]
            if extra:
                raise _fail(f"noul criteria keys must be 'true' and/or 'false', got {', '.join(map(repr, extra))}")
            return criteria
        if kind is None:  # the type failed already
            return criteria
        if not criteria:
            raise _fail(f"a {kind} question needs non-empty criteria")
        if kind == "choice":
            if not isinstance(criteria, dict):
                raise _fail(f"choice criteria must be an object mapping option id to description, got {_kind(criteria)}")
            _check_duplicates(criteria, "duplicate option id(s)", None)
            if any(k == "" for k in criteria):
                raise _fail("option ids must be non-empty")
        elif not isinstance(criteria, list):
            raise _fail(f"score criteria must be an array of levels (lowest first), got {_kind(criteria)}")
        if len(criteria) > MAX_OPTIONS_PER_QUESTION:
            raise _fail(f"{len(criteria)} options; at most {MAX_OPTIONS_PER_QUESTION} options per question")
        return criteria

    @property
    def num_options(self) -> int:
        return 2 if self.type == "noul" else len(self.criteria)


class Asset(_Strict):
    """An image asset, as the TypeSafe SDK writes it: a multipart part's name, or base64 data."""

    type: Literal["image"] = "image"
    format: Literal["png", "jpg", "jpeg", "webp"] | None = None  # informational: the bytes say what they are
    data_base64: str | None = None
    part: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _shape(cls, data: Any) -> Any:
        data = _object_with(data, ASSET_FIELDS)
        if (data.get("part") is None) == (data.get("data_base64") is None):
            raise _fail("give the multipart 'part' that holds the image, or its 'data_base64', exactly one of them")
        return data


def _image_entry(entry: Any, where: str) -> Any:
    """An `images` entry -> its URL string (chat-style objects unwrapped); other Python objects
    (PIL images, arrays: the offline API's) as they are."""
    if isinstance(entry, dict):
        ref = entry.get("image_url")
        url = ref.get("url") if isinstance(ref, dict) else ref
        if set(entry) - {"type", "image_url"} or entry.get("type", "image_url") not in ("image_url", "input_image") \
                or not isinstance(url, str) or not url:
            raise _fail(f'{where}: an image object is {{"image_url": {{"url": "..."}}}} (optionally with '
                        '"type": "image_url")', where)
        return url
    if isinstance(entry, str) and entry:
        return entry
    if entry is None or isinstance(entry, (str, int, float, bool, list, tuple)):
        raise _fail(f"{where} must be a non-empty string: an http(s) URL, a data URL or base64 data (or an "
                    '{"image_url": {"url": ...}} object)', where)
    return entry


class SystemOneRequest(_Strict):
    """A validated systemone body. Validate with `validate(body, parts)` (ClefRequestError on refusal)."""

    model: str
    state: Any
    questions: dict[str, Question]
    images: tuple[Any, ...] = ()
    assets: dict[str, Asset] | None = None
    videos: Any = None
    max_length: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _body(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            raise _fail(f"request body must be a JSON object, got {_kind(data)}")
        check_json_values(data)  # first: messages below may quote the body's strings
        unknown = [k for k in data if k not in TOP_LEVEL_FIELDS]
        if unknown:
            raise _fail(f"unknown field(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(TOP_LEVEL_FIELDS)}",
                        unknown[0])
        return data

    @field_validator("model", mode="before")
    @classmethod
    def _model(cls, model: Any) -> str:
        if not isinstance(model, str) or not model:
            raise _fail("'model' is required and must be a non-empty string")
        return model

    @field_validator("questions", mode="before")
    @classmethod
    def _questions(cls, questions: Any) -> Any:
        if not isinstance(questions, dict):
            raise _fail(f"'questions' must be an object mapping question id to question, got {_kind(questions)}")
        if not questions:
            raise _fail("'questions' is empty: at least one question is required")
        _check_duplicates(questions, "question id(s)", "questions")
        if len(questions) > MAX_QUESTIONS:
            raise _fail(f"{len(questions)} questions; at most {MAX_QUESTIONS} questions per record")
        if "" in questions:
            raise _fail("question ids must be non-empty strings")
        return questions

    @field_validator("images", mode="before")
    @classmethod
    def _images(cls, images: Any) -> tuple:
        if images is None:
            return ()
        if not isinstance(images, (list, tuple)):
            raise _fail(f"'images' must be an array, got {_kind(images)}")
        if len(images) > MAX_IMAGES:
            raise _fail(f"{len(images)} images; at most {MAX_IMAGES} images per record")
        return tuple(_image_entry(e, f"images[{i}]") for i, e in enumerate(images))

    @field_validator("assets", mode="before")
    @classmethod
    def _assets(cls, assets: Any) -> Any:
        if assets is None:
            return None
        if not isinstance(assets, dict):
            raise _fail(f"'assets' must be an object mapping placeholder to asset, got {_kind(assets)}")
        if not assets:
            raise _fail("'assets' is empty: leave it out, or give at least one asset")
        _check_duplicates(assets, "asset placeholder(s)", "assets")
        if "" in assets:
            raise _fail("asset placeholders must be non-empty strings")
        return assets

    @field_validator("videos", mode="before")
    @classmethod
    def _videos(cls, videos: Any) -> None:
        if videos not in (None, []):
            raise _fail("videos are not supported for Clef records (Clef takes images only)")
        return None

    @field_validator("max_length", mode="before")
    @classmethod
    def _max_length(cls, value: Any) -> int | None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise _fail(f"'max_length' must be a positive integer, got {value!r}")
        return value

    @model_validator(mode="after")
    def _totals(self, info: ValidationInfo) -> "SystemOneRequest":
        total = sum(q.num_options for q in self.questions.values())
        if total > MAX_OPTIONS_TOTAL:
            raise _fail(f"the questions have {total} options in total; at most {MAX_OPTIONS_TOTAL} options per "
                        "record", "questions")
        if self.num_images > MAX_IMAGES:
            raise _fail(f"{len(self.images)} images and {len(self.assets)} assets; at most {MAX_IMAGES} images per "
                        "record", "assets")
        _check_parts(self.assets or {}, set((info.context or {}).get("parts") or ()))
        return self

    # -- what the record is made of -------------------------------------------------------------
    @property
    def num_images(self) -> int:
        return len(self.images) + len(self.assets or {})

    def image_sources(self, parts: Mapping[str, bytes] | None = None) -> list[tuple[Any, str]]:
        """(source, where) of every image in record order: `images` entries (URL strings, or the
        offline API's objects), then the assets: a part's bytes, or the base64 text."""
        out: list[tuple[Any, str]] = [(e, f"images[{i}]") for i, e in enumerate(self.images)]
        for key, asset in (self.assets or {}).items():
            out.append((parts[asset.part] if asset.part is not None else asset.data_base64, f"assets.{key}"))
        return out

    def record(self) -> dict[str, Any]:
        """The record as encode_record reads it, each asset placeholder replaced by its image label."""
        sub = _placeholders({k: f"[image {len(self.images) + i + 1}]" for i, k in enumerate(self.assets or {})})
        questions = {}
        for qid, q in self.questions.items():
            criteria = q.criteria
            if isinstance(criteria, dict):
                criteria = {k: sub(v) for k, v in criteria.items()}
            elif isinstance(criteria, list):
                criteria = [sub(v) for v in criteria]
            questions[qid] = {"type": q.type, "instructions": sub(q.instructions), "criteria": criteria}
        return {"state": sub(self.state), "questions": questions, "images": [None] * self.num_images}


def _check_parts(assets: Mapping[str, Asset], parts: set[str]) -> None:
    """Every multipart part is claimed by exactly one asset, and every asset's part exists."""
    claimed: dict[str, str] = {}
    for key, asset in assets.items():
        if asset.part is None:
            continue
        if asset.part not in parts:
            raise _fail(f"asset {key!r} names part {asset.part!r}, which the request does not have"
                        + ("" if parts else " (it is not a multipart body)"), f"assets.{key}.part")
        if asset.part in claimed:
            raise _fail(f"assets {claimed[asset.part]!r} and {key!r} both name part {asset.part!r}; each part "
                        "belongs to one asset", f"assets.{key}.part")
        claimed[asset.part] = key
    unused = sorted(parts - set(claimed))
    if unused:
        raise _fail(f"multipart part(s) {', '.join(map(repr, unused))} belong to no asset", "assets")


def _placeholders(labels: Mapping[str, str]):
    """value -> value with every placeholder inside its strings replaced by its label."""
    if not labels:
        return lambda value: value
    pattern = re.compile("|".join(re.escape(k) for k in sorted(labels, key=len, reverse=True)))

    def sub(value: Any) -> Any:
        if isinstance(value, str):
            return pattern.sub(lambda m: labels[m.group(0)], value)
        if isinstance(value, dict):
            return {k: sub(v) for k, v in value.items()}
        if isinstance(value, list):
            return [sub(v) for v in value]
        return value
    return sub


def _refusal(exc: ValidationError) -> ClefRequestError:
    """pydantic's first error as a ClefRequestError: the message names the field (and the question)."""
    err = exc.errors(include_url=False)[0]
    loc = tuple(str(p) for p in err["loc"])
    ctx = err.get("ctx") or {}
    path = ".".join(loc) or None
    within = len(loc) >= 2 and loc[0] in ("questions", "assets")  # named by the question or asset
    if err["type"] == "clef":
        message, param = ctx["message"], ctx.get("param") or path
    elif err["type"] == "missing":
        message, param = f"'{loc[-1]}' is required", path
    else:
        message, param = f"'{'.'.join(loc[2:]) if within else path}': {err['msg']}", path
    if within:
        message = f"{loc[0][:-1]} {loc[1]!r}: {message}"
    return ClefRequestError(message, param)


def validate(body: Any, parts: Mapping[str, bytes] | None = None) -> SystemOneRequest:
    """A body (JSON text, or already decoded) and its multipart parts, if it came as multipart (name ->
    bytes, the `request` part removed) -> the request; ClefRequestError on refusal."""
    if isinstance(body, (bytes, bytearray, str)):
        body = decode_json(body)
    try:
        return SystemOneRequest.model_validate(body, context={"parts": set(parts or ())})
    except ValidationError as exc:
        raise _refusal(exc) from None


# ---- encoding ------------------------------------------------------------------------------------
def effective_max_length(requested: int | None, nmax: int, cap_name: str = "QV_CLEF_NMAX") -> int:
    """Clef's default (16,384) unless the request lowers it; never above the server cap."""
    if requested is None:
        return min(DEFAULT_MAX_LENGTH, nmax)
    if requested > nmax:
        raise ClefRequestError(f"max_length {requested} is over this server's Clef record cap of {nmax} tokens "
                               f"({cap_name})", "max_length")
    return requested


def encode_request(tokenizer: Any, body: SystemOneRequest | Mapping, nmax: int, tokenize: Tokenize | None = None,
                   cap_name: str = "QV_CLEF_NMAX", images: Sequence = (), multimodal: Any = None,
                   max_chars_per_token: int | None = None) -> EncodedRecord:
    """Encode a request (a body is validated first): the record the engine will run. `nmax` is the
    server's record cap and `cap_name` what sets it (named in the messages).

    A request with images needs them preprocessed, in record order (`images`: VisionItems from the
    checkpoint's processor), and `multimodal`, the engine's prompt builder
    (qv.engine.multimodal.MultimodalInputs); the record then carries its MultimodalPrompt.
    `max_chars_per_token`: the most characters one token can stand for (the server's TextBound:
    max_token_bytes * shrink); with it, questions too long for the cap are refused by their size."""
    request = body if isinstance(body, SystemOneRequest) else validate(body)
    if max_chars_per_token is not None:  # before any of it is tokenized: a schema may be megabytes
        chars = sum(len(render(q.instructions)) + len(render(q.criteria)) for q in request.questions.values())
        if chars // max_chars_per_token > nmax:
            raise ClefRequestError(f"record too long: the questions' text ({chars} characters) makes at least "
                                   f"{chars // max_chars_per_token} tokens, more than the {nmax}-token Clef record "
                                   f"cap ({cap_name})", "questions")
    n_images = request.num_images
    if n_images and multimodal is None:
        raise ClefRequestError("this model takes no images (it has no vision tower): send the record without "
                               "'images' or 'assets'", "images" if request.images else "assets")
    if n_images != len(images):
        raise ClefRequestError(f"the record has {n_images} images but {len(images)} were given", "images")
    tokenize = tokenize or batch_tokenizer(tokenizer)
    placeholders = tokenize([media_text(n_images)])[0] if n_images else []
    media_ids = multimodal.prompt(placeholders, images).token_ids if n_images else None
    max_length = effective_max_length(request.max_length, nmax, cap_name)
    try:
        record = encode_record(tokenizer, request.record(), max_length=max_length, tokenize=tokenize,
                               media_ids=media_ids)
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
