"""qv's record encoder against Cloudflare's `encode_record`: ids, spans, option ids and order,
question types, truncation, and the schema-too-long refusal, on varied records. The state is
tokenized only as far as the record has room: the ids equal tokenizing the whole state, on
adversarial texts, and a 10 MB state costs what its first tokens cost."""

from __future__ import annotations

import pytest

from clef_records import encode_cases, make_record
from qv.clef.encode import SchemaTooLong, batch_tokenizer, encode_record, offsets_tokenizer, render, truncated_ids

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
    assert ours.state_truncated == (ours.state_tokens < full) and ours.state_tokens <= full


def test_truncation_cases_do_truncate(tokenizers):
    cut = [encode_record(tokenizers["release"], r, max_length=m) for r, m in CASES if m < 16384]
    assert cut and all(r.state_truncated for r in cut)


PIECES = ["a", "b", " ", "  ", "\n", "\r\n", "\t", "é", "e\u0301", "😀", "Привет", "こんにちは世界", "<|im_end|>",
          "<think>", "42", "3.14", ".", "!!", "aaaaaaaa", "the ", "quick ", "'s", "'ll", "\u00a0", "  \n  ", "___"]


@pytest.mark.parametrize("seed", range(6))
def test_state_prefix_gives_the_whole_states_ids(clef_dirs, tokenizers, seed):
    """truncated_ids on random texts of every kind (long runs without spaces, whitespace runs,
    combining marks, emoji split into bytes, special tokens) and budgets up to and past the text's
    tokens: the ids of tokenizing the whole text, cut to the budget, with both tokenizer kinds."""
    import random

    from tokenizers import Tokenizer

    rng = random.Random(seed)
    raw = Tokenizer.from_file(str(clef_dirs["release"] / "tokenizer.json"))
    for tok in (tokenizers["release"], raw):
        whole, offsets = batch_tokenizer(tok), offsets_tokenizer(tok)
        assert offsets is not None
        for _ in range(25):
            weights = [rng.random() ** 3 for _ in PIECES]
            text = "".join(rng.choices(PIECES, weights, k=rng.choice([3, 60, 700, 4000])))
            full = whole([text])[0]
            for budget in {0, 1, 7, len(full) // 3, len(full) - 1, len(full), len(full) + 5}:
                ids, truncated = truncated_ids(text, max(budget, 0), whole, offsets)
                assert ids == full[:max(budget, 0)] and truncated == (len(full) > max(budget, 0)), (seed, budget)


class _CountingTokenizer:
    """A transformers tokenizer that counts the characters it is asked to tokenize."""

    def __init__(self, tok):
        self._tok, self.chars = tok, 0

    def __call__(self, text, **kw):
        self.chars += len(text) if isinstance(text, str) else sum(map(len, text))
        return self._tok(text, **kw)

    def __getattr__(self, name):
        return getattr(self._tok, name)


def test_ten_megabyte_state_costs_its_first_tokens(tokenizers):
    """A 10 MB state in a 4,096-token record: only a prefix of it is tokenized (tokenizing it whole
    takes tens of seconds on real tokenizers), and the ids are those of the state's first 200 KB."""
    tok = _CountingTokenizer(tokenizers["release"])
    words = "the checkout fails again and every order is blocked ".split()
    state = {"log": " ".join(words[i % len(words)] for i in range(2_000_000)), "tail": "x" * 100_000}
    assert len(render(state)) > 10_000_000
    record = make_record(1, n_questions=2)
    rec = encode_record(tok, dict(record, state=state), max_length=4096)
    assert rec.num_tokens == 4096 and rec.state_truncated
    assert tok.chars < 1_000_000, f"{tok.chars} characters tokenized for a 4,096-token record"
    head = render(state)[:200_000]
    short = encode_record(tokenizers["release"], dict(record, state=head), max_length=4096)
    assert short.input_ids == rec.input_ids


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
