"""qv's record encoder against Cloudflare's `encode_record`: ids, spans, option ids and order,
question types, truncation, and the schema-too-long refusal, on varied records."""

from __future__ import annotations

import pytest

from clef_records import encode_cases, make_record
from qv.clef.encode import SchemaTooLong, encode_record

CASES = encode_cases()


def _fields(rec):
    return (tuple(rec.input_ids),
            [(q.question_id, q.question_type, q.question_span, q.option_spans, q.option_ids) for q in rec.questions])


def test_enough_varied_cases():
    assert len(CASES) >= 30
    states = {type(r["state"]).__name__ for r, _ in CASES}
    assert {"str", "dict", "list"} <= states, states
    types_ = {q["type"] for r, _ in CASES for q in r["questions"].values()}
    assert types_ == {"noul", "choice", "score"}
    counts = {len(r["questions"]) for r, _ in CASES}
    assert 1 in counts and 64 in counts


@pytest.mark.parametrize("index", range(len(CASES)))
def test_encode_matches_clef(jsm, tokenizers, index):
    record, max_length = CASES[index]
    tok = tokenizers["release"]
    ref = jsm.encode_record(tok, record, max_length=max_length)
    ours = encode_record(tok, record, max_length=max_length)
    assert _fields(ours) == _fields(ref)
    assert ours.num_tokens <= max_length
    # the state really was cut for the truncation cases, and left whole otherwise
    full = len(tok(jsm.render(record["state"]), add_special_tokens=False).input_ids)
    assert ours.state_tokens + ours.state_dropped == full


def test_truncation_cases_do_truncate(tokenizers):
    cut = [encode_record(tokenizers["release"], r, max_length=m) for r, m in CASES if m < 16384]
    assert cut and all(r.state_dropped > 0 for r in cut)


def test_max_state_tokens_matches_clef(jsm, tokenizers):
    tok = tokenizers["release"]
    record = make_record(7, state_size=200)
    for limit in (0, 5, 37):
        assert _fields(encode_record(tok, record, max_state_tokens=limit)) == \
            _fields(jsm.encode_record(tok, record, max_state_tokens=limit))


def test_schema_too_long_like_clef(jsm, tokenizers):
    tok = tokenizers["release"]
    record = make_record(3, n_questions=9)
    fixed = len(encode_record(tok, dict(record, state="")).input_ids)
    with pytest.raises(ValueError, match=f"schema requires {fixed} tokens before state; maximum is {fixed - 1}"):
        jsm.encode_record(tok, record, max_length=fixed - 1)
    with pytest.raises(SchemaTooLong) as err:
        encode_record(tok, record, max_length=fixed - 1)
    assert (err.value.fixed, err.value.max_length) == (fixed, fixed - 1)
    exact = encode_record(tok, record, max_length=fixed)  # fits with an empty state
    assert exact.state_tokens == 0 and exact.num_tokens == fixed


def test_tokenizers_library_gives_the_same_record(clef_dirs, tokenizers):
    """The engine may hold a `tokenizers.Tokenizer` instead of a transformers tokenizer."""
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(clef_dirs["release"] / "tokenizer.json"))
    for record, max_length in CASES[::5]:
        assert _fields(encode_record(raw, record, max_length)) == \
            _fields(encode_record(tokenizers["release"], record, max_length))


def test_checksum_identifies_the_ids(tokenizers):
    tok = tokenizers["release"]
    a, b = encode_record(tok, make_record(1)), encode_record(tok, make_record(2))
    assert a.checksum == encode_record(tok, make_record(1)).checksum
    assert a.checksum != b.checksum
