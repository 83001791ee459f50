"""Every refused systemone body gives a ClefRequestError (HTTP 400) whose message names the limit;
bodies exactly at each limit pass."""

from __future__ import annotations

import json

import pytest

from qv.clef.request import (MAX_IMAGES, MAX_OPTIONS_PER_QUESTION, MAX_OPTIONS_TOTAL, MAX_QUESTIONS,
                             ClefRequestError, encode_request, parse_body, validate_request)
from qv.errors import InvalidRequestError

NMAX = 34816
OK_Q = {"type": "noul", "instructions": "Is it down?"}


def body(**overrides):
    b = {"model": "clef", "state": "the checkout fails", "questions": {"q": dict(OK_Q)}}
    b.update(overrides)
    return {k: v for k, v in b.items() if v is not ...}


def choice(n: int) -> dict:
    return {"type": "choice", "criteria": {f"o{i}": None for i in range(n)}}


BAD = [  # (id, body, message fragment, param)
    ("not-object", [1, 2], "must be a JSON object", None),
    ("unknown-field", body(temperature=0.2), "unknown field(s) 'temperature'", "temperature"),
    ("no-model", body(model=...), "'model' is required", "model"),
    ("model-not-string", body(model=3), "'model' is required", "model"),
    ("no-state", body(state=...), "'state' is required", "state"),
    ("no-questions", body(questions=...), "'questions' must be an object", "questions"),
    ("questions-list", body(questions=[OK_Q]), "'questions' must be an object", "questions"),
    ("questions-empty", body(questions={}), "at least one question is required", "questions"),
    ("too-many-questions", body(questions={f"q{i}": OK_Q for i in range(MAX_QUESTIONS + 1)}),
     "65 questions; at most 64 questions", "questions"),
    ("question-not-object", body(questions={"q": "is it down?"}), "question 'q' must be an object", "questions.q"),
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
     "has 257 options; at most 256 options per question", "questions.q.criteria"),
    ("score-levels-per-question", body(questions={"q": {"type": "score", "criteria": [None] * 257}}),
     "has 257 options; at most 256 options per question", "questions.q.criteria"),
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
]


def test_enough_cases():
    assert len(BAD) >= 20


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_names_the_limit(tokenizers, case):
    _, b, fragment, param = case
    with pytest.raises(ClefRequestError) as err:
        encode_request(tokenizers["release"], b, NMAX, served_models=["clef"])
    assert fragment in str(err.value), str(err.value)
    assert err.value.param == param
    assert isinstance(err.value, InvalidRequestError)  # the server's 400 class


def test_model_not_served():
    with pytest.raises(ClefRequestError, match="model 'jev-latest' is not served here; served: clef"):
        validate_request(body(model="jev-latest"), served_models=["clef"])


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
        validate_request(parse_body(raw.encode()))
    assert fragment in str(err.value)


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
        record = encode_request(tok, parse_body(json.dumps(b)), NMAX, served_models=["clef"])
        assert record.num_tokens <= NMAX


def test_long_state_is_cut_silently(tokenizers):
    long = body(state="word " * 3000, max_length=800)
    record = encode_request(tokenizers["release"], long, NMAX)
    assert record.num_tokens == 800 and record.state_truncated
