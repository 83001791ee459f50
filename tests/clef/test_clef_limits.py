"""Every refused systemone body gives a ClefRequestError (HTTP 400) whose message names the limit;
bodies exactly at each limit pass. The one validation is qv.clef.request.SystemOneRequest; the
model name is the server's to check (tests/server/test_systemone.py)."""

from __future__ import annotations

import json

import pytest

from qv.clef.limits import MAX_JSON_DEPTH
from qv.clef.request import (MAX_IMAGES, MAX_OPTIONS_PER_QUESTION, MAX_OPTIONS_TOTAL, MAX_QUESTIONS,
                             ClefRequestError, decode_json, encode_request, validate)
from qv.errors import InvalidRequestError

NMAX = 34816
OK_Q = {"type": "noul", "instructions": "Is it down?"}


def body(**overrides):
    b = {"model": "clef", "state": "the checkout fails", "questions": {"q": dict(OK_Q)}}
    b.update(overrides)
    return {k: v for k, v in b.items() if v is not ...}


def _nested(depth: int):
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def choice(n: int) -> dict:
    return {"type": "choice", "criteria": {f"o{i}": None for i in range(n)}}


BAD = [  # (id, body, message fragment, param)
    ("not-object", [1, 2], "must be a JSON object, got array", None),
    ("unknown-field", body(temperature=0.2), "unknown field(s) 'temperature'", "temperature"),
    ("no-model", body(model=...), "'model' is required", "model"),
    ("model-not-string", body(model=3), "'model' is required", "model"),
    ("no-state", body(state=...), "'state' is required", "state"),
    ("no-questions", body(questions=...), "'questions' is required", "questions"),
    ("questions-list", body(questions=[OK_Q]), "'questions' must be an object", "questions"),
    ("questions-empty", body(questions={}), "at least one question is required", "questions"),
    ("too-many-questions", body(questions={f"q{i}": OK_Q for i in range(MAX_QUESTIONS + 1)}),
     "65 questions; at most 64 questions", "questions"),
    ("question-not-object", body(questions={"q": "is it down?"}), "question 'q': must be an object, got string",
     "questions.q"),
    ("empty-question-id", body(questions={"": OK_Q}), "question ids must be non-empty", "questions"),
    ("unknown-question-field", body(questions={"q": dict(OK_Q, labels="true")}), "unknown field(s) 'labels'",
     "questions.q"),
    ("unknown-type", body(questions={"q": {"type": "box"}}), "unknown type 'box'; supported: noul, choice, score",
     "questions.q.type"),
    ("missing-type", body(questions={"q": {"instructions": "x"}}), "unknown type None", "questions.q.type"),
    ("choice-no-criteria", body(questions={"q": {"type": "choice"}}), "choice question needs non-empty criteria",
     "questions.q.criteria"),
    ("choice-empty-criteria", body(questions={"q": {"type": "choice", "criteria": {}}}),
     "choice question needs non-empty criteria", "questions.q.criteria"),
    ("score-no-criteria", body(questions={"q": {"type": "score", "criteria": []}}),
     "score question needs non-empty criteria", "questions.q.criteria"),
    ("choice-criteria-list", body(questions={"q": {"type": "choice", "criteria": ["a", "b"]}}),
     "choice criteria must be an object", "questions.q.criteria"),
    ("score-criteria-object", body(questions={"q": {"type": "score", "criteria": {"0": "low"}}}),
     "score criteria must be an array", "questions.q.criteria"),
    ("empty-option-id", body(questions={"q": {"type": "choice", "criteria": {"": "nothing", "a": None}}}),
     "option ids must be non-empty", "questions.q.criteria"),
    ("noul-bad-criteria", body(questions={"q": {"type": "noul", "criteria": {"yes": "y"}}}),
     "noul criteria keys must be 'true' and/or 'false'", "questions.q.criteria"),
    ("noul-criteria-list", body(questions={"q": {"type": "noul", "criteria": ["y", "n"]}}),
     "noul criteria must be an object", "questions.q.criteria"),
    ("options-per-question", body(questions={"q": choice(MAX_OPTIONS_PER_QUESTION + 1)}),
     "question 'q': 257 options; at most 256 options per question", "questions.q.criteria"),
    ("score-levels-per-question", body(questions={"q": {"type": "score", "criteria": [None] * 257}}),
     "question 'q': 257 options; at most 256 options per question", "questions.q.criteria"),
    ("options-total", body(questions={"a": choice(224), "b": choice(224), "c": OK_Q}),
     "450 options in total; at most 448 options per record", "questions"),
    ("too-many-images", body(images=["data:image/png;base64,AAAA"] * (MAX_IMAGES + 1)),
     "17 images; at most 16 images", "images"),
    ("type-array", body(questions={"q": {"type": ["noul"]}}), "question 'q': unknown type ['noul']", "questions.q.type"),
    ("type-object", body(questions={"q": {"type": {}}}), "question 'q': unknown type {}", "questions.q.type"),
    ("images-not-list", body(images="https://example.com/a.png"), "'images' must be an array", "images"),
    ("videos", body(videos=["https://example.com/a.mp4"]), "videos are not supported", "videos"),
    ("max-length-zero", body(max_length=0), "'max_length' must be a positive integer", "max_length"),
    ("max-length-bool", body(max_length=True), "'max_length' must be a positive integer", "max_length"),
    ("max-length-string", body(max_length="4096"), "'max_length' must be a positive integer", "max_length"),
    ("max-length-over-cap", body(max_length=NMAX + 1), f"max_length {NMAX + 1} is over this server's Clef record "
     f"cap of {NMAX} tokens", "max_length"),
    ("score-nan", body(questions={"q": {"type": "score", "criteria": [float("nan"), float("inf")]}}),
     "questions.q.criteria[0]: NaN is not a number JSON allows", "questions.q.criteria[0]"),
    ("state-infinity", body(state={"x": [1, float("-inf")]}), "state.x[1]: -Infinity is not a number JSON allows",
     "state.x[1]"),
    ("state-surrogate", body(state="ok \ud83d then"), "state: a lone UTF-16 surrogate ('\\ud83d' at character 3)",
     "state"),
    ("key-surrogate", body(state={"k\udc00": 1}), "state.k\\udc00: a lone UTF-16 surrogate", "state.k\\udc00"),
    ("instructions-surrogate", body(questions={"q": {"type": "noul", "instructions": ["\udfff"]}}),
     "questions.q.instructions[0]: a lone UTF-16 surrogate", "questions.q.instructions[0]"),
    ("deep-state", body(state=_nested(MAX_JSON_DEPTH + 5)), f"state: JSON nested deeper than {MAX_JSON_DEPTH}",
     "state"),
    ("image-object", body(images=[{"url": "https://example.com/a.png"}]),
     'images[0]: an image object is {"image_url": {"url": "..."}}', "images[0]"),
    ("image-number", body(images=[7]), "images[0] must be a non-empty string", "images[0]"),
    ("assets-empty", body(assets={}), "'assets' is empty", "assets"),
    ("assets-list", body(assets=["<image:0>"]), "'assets' must be an object", "assets"),
    ("asset-no-data", body(assets={"<image:0>": {"type": "image"}}), "asset '<image:0>': give the multipart 'part'",
     "assets.<image:0>"),
    ("asset-both", body(assets={"<image:0>": {"part": "asset-0", "data_base64": "AAAA"}}),
     "asset '<image:0>': give the multipart 'part'", "assets.<image:0>"),
    ("asset-video", body(assets={"<image:0>": {"type": "video", "data_base64": "AAAA"}}),
     "asset '<image:0>': 'type': Input should be 'image'", "assets.<image:0>.type"),
    ("asset-unknown-field", body(assets={"<image:0>": {"data_base64": "AAAA", "url": "x"}}),
     "asset '<image:0>': unknown field(s) 'url'", "assets.<image:0>"),
    ("asset-part-not-multipart", body(assets={"<image:0>": {"type": "image", "part": "asset-0"}}),
     "asset '<image:0>' names part 'asset-0', which the request does not have (it is not a multipart body)",
     "assets.<image:0>.part"),
    ("images-and-assets", body(images=["AAAA"] * 10, assets={f"<image:{i}>": {"data_base64": "AAAA"} for i in range(7)}),
     "10 images and 7 assets; at most 16 images per record", "assets"),
]



def test_enough_cases():
    assert len(BAD) >= 20


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_names_the_limit(tokenizers, case):
    _, b, fragment, param = case
    with pytest.raises(ClefRequestError) as err:
        encode_request(tokenizers["release"], b, NMAX)
    assert fragment in str(err.value), str(err.value)
    assert err.value.param == param
    str(err.value).encode("utf-8"), param and param.encode("utf-8")  # the 400 body can be written as JSON
    assert isinstance(err.value, InvalidRequestError)  # the server's 400 class


def test_multipart_parts_are_claimed_once_each():
    a = {"type": "image", "part": "asset-0"}
    ok = validate(body(assets={"<image:a>": a}), parts={"asset-0": b"png"})
    assert [(type(s), w) for s, w in ok.image_sources({"asset-0": b"png"})] == [(bytes, "assets.<image:a>")]
    with pytest.raises(ClefRequestError, match=r"assets '<image:a>' and '<image:b>' both name part 'asset-0'"):
        validate(body(assets={"<image:a>": a, "<image:b>": a}), parts={"asset-0": b""})
    with pytest.raises(ClefRequestError, match=r"multipart part\(s\) 'asset-1' belong to no asset"):
        validate(body(assets={"<image:a>": a}), parts={"asset-0": b"", "asset-1": b""})
    with pytest.raises(ClefRequestError, match=r"names part 'asset-0', which the request does not have$"):
        validate(body(assets={"<image:a>": a}), parts={"asset-9": b""})


def test_placeholders_become_image_labels_in_record_order():
    """Each asset's placeholder, wherever it is inside a string of the state, instructions or
    criteria, reads "[image N]": N counts `images` first, then the assets in the body's order."""
    b = body(state={"photo": "see <image:b> and <image:a>", "n": [1, "<image:b>"]}, images=["AAAA"],
             assets={"<image:a>": {"data_base64": "AAAA"}, "<image:b>": {"data_base64": "BBBB"}},
             questions={"q": {"type": "choice", "instructions": "Is <image:a> the same as <image:b>?",
                              "criteria": {"same": "<image:a> = <image:b>", "other": None}},
                        "s": {"type": "score", "criteria": ["<image:a>x", "y"]}})
    req = validate(b)
    rec = req.record()
    assert rec["state"] == {"photo": "see [image 3] and [image 2]", "n": [1, "[image 3]"]}
    assert rec["questions"]["q"]["instructions"] == "Is [image 2] the same as [image 3]?"
    assert rec["questions"]["q"]["criteria"] == {"same": "[image 2] = [image 3]", "other": None}
    assert rec["questions"]["s"]["criteria"] == ["[image 2]x", "y"]
    assert [w for _, w in req.image_sources()] == ["images[0]", "assets.<image:a>", "assets.<image:b>"]
    assert [s for s, _ in req.image_sources()] == ["AAAA", "AAAA", "BBBB"]
    assert b["state"]["photo"] == "see <image:b> and <image:a>"  # the body itself is left as it was


def test_chat_style_image_entries_are_urls():
    forms = [{"image_url": {"url": "https://e.com/a.png", "detail": "high"}}, {"type": "image_url", "image_url": "B"},
             {"type": "input_image", "image_url": "C"}, "D"]
    assert validate(body(images=forms)).images == ("https://e.com/a.png", "B", "C", "D")


def test_schema_over_max_length_gives_counts(tokenizers):
    b = body(questions={f"q{i}": choice(3) for i in range(20)}, max_length=500)
    with pytest.raises(ClefRequestError, match=r"record too long: the template, images and questions take \d+ tokens "
                       r"before any state \(\d+ of them the schema\), more than the 500-token max_length"):
        encode_request(tokenizers["release"], b, NMAX)


def test_schema_over_server_cap_names_the_cap(tokenizers):
    b = body(questions={f"q{i}": choice(3) for i in range(20)})
    with pytest.raises(ClefRequestError, match=r"more than the 300-token Clef record cap \(QV_CLEF_NMAX\)"):
        encode_request(tokenizers["release"], b, nmax=300)


@pytest.mark.parametrize("raw, fragment", [
    ('{"model": "clef", "state": "", "questions": {"q": {"type": "choice", "criteria": {"a": 1, "a": 2}}}}',
     "duplicate option id(s) 'a' given more than once"),
    ('{"model": "clef", "state": "", "questions": {"q": {"type": "noul"}, "q": {"type": "noul"}}}',
     "question id(s) 'q' given more than once"),
    ('{"model": "clef", "state": ', "request body is not valid JSON"),
    ('"just a string"', "request body must be a JSON object"),
])
def test_raw_body_refusals(raw, fragment):
    with pytest.raises(ClefRequestError) as err:
        validate(raw.encode())  # JSON text: validate decodes it
    assert fragment in str(err.value)


@pytest.mark.parametrize("raw, fragment", [
    ('{"model": "clef", "state": NaN, "questions": {"q": {"type": "noul"}}}', "state: NaN is not a number"),
    ('{"model": "clef", "state": "", "questions": {"q": {"type": "score", "criteria": [NaN, Infinity]}}}',
     "questions.q.criteria[0]: NaN is not a number JSON allows"),
    ('{"model": "clef", "state": 1e999, "questions": {"q": {"type": "noul"}}}', "state: Infinity is not a number"),
    ('{"model": "clef", "state": "a\\ud800b", "questions": {"q": {"type": "noul"}}}', "state: a lone UTF-16 surrogate"),
    ('{"model": "clef", "state": "", "questions": {"\\udc01": {"type": "noul"}}}', "questions.\\udc01: a lone UTF-16"),
    ('{"model": "clef", "state": ' + "[" * 5000 + "]" * 5000 + ', "questions": {}}', "request body is not valid JSON"),
])
def test_json_that_is_not_json_is_refused(raw, fragment):
    with pytest.raises(ClefRequestError) as err:
        validate(raw.encode())  # JSON text: validate decodes it
    assert fragment in str(err.value), str(err.value)


def test_bodies_at_the_limits_pass(tokenizers):
    tok = tokenizers["release"]
    at_limits = [
        body(questions={f"q{i}": OK_Q for i in range(MAX_QUESTIONS)}),
        body(questions={"q": choice(MAX_OPTIONS_PER_QUESTION)}),
        body(questions={"a": choice(224), "b": choice(224)}),  # exactly 448
        body(images=[], videos=[], max_length=NMAX),
        body(state={"any": ["json", 1, None]}, questions={"q": {"type": "noul", "criteria": {"true": "yes"}}}),
    ]
    assert sum(len(q["criteria"]) for q in at_limits[2]["questions"].values()) == MAX_OPTIONS_TOTAL
    for b in at_limits:
        record = encode_request(tok, decode_json(json.dumps(b)), NMAX)
        assert record.num_tokens <= NMAX


def test_long_state_is_cut_silently(tokenizers):
    long = body(state="word " * 3000, max_length=800)
    record = encode_request(tokenizers["release"], long, NMAX)
    assert record.num_tokens == 800 and record.state_truncated
