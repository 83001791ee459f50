"""bad_words (vLLM's rule, qv/engine/bad_words.py): the banned token sequences of a word, the bans
after a row's latest tokens, the sampler's bans on their rows only, and the engine's greedy
outputs, built from the unconstrained ones: a banned word never appears where it otherwise would,
everything before it is unchanged, a word of several tokens is banned only after its prefix, and
speculative decoding gives the same output. Bad input is refused naming the field."""

from __future__ import annotations

import random

import httpx
import pytest
import torch

from qv import SamplingParams
from qv.engine.bad_words import banned_next, batch_bans, token_sequences
from qv.engine.request import InvalidFieldError
from qv.engine.sampler import SamplingBatch, sample


def contains(ids: list[int], seq: list[int]) -> bool:
    return any(ids[i:i + len(seq)] == seq for i in range(len(ids) - len(seq) + 1))


def test_banned_next_follows_the_latest_tokens():
    seqs = [[5], [7, 8], [1, 2, 3]]
    cases = {(): {5}, (7,): {5, 8}, (1, 2): {5, 3}, (9, 1, 2): {5, 3}, (1, 2, 7): {5, 8}, (2, 1): {5},
             (7, 9): {5}, (1, 2, 3): {5}}
    for out, want in cases.items():
        assert set(banned_next(seqs, list(out))) == want, out


def test_token_sequences_with_and_without_a_space(tiny_dirs):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dirs("tiny"))
    vocab = len(tok)
    for word in ["model", " engine", "Paris", "😀", "tokens; the"]:
        plain = tok.encode(word.lstrip(), add_special_tokens=False)
        spaced = tok.encode(" " + word.lstrip(), add_special_tokens=False)
        want = [plain] + ([spaced] if spaced[0] != plain[0] and len(spaced) == len(plain) else [])
        assert token_sequences(tok, [word], vocab) == want, word
    with pytest.raises(InvalidFieldError) as err:  # 1,024 tokens at most in all
        token_sequences(tok, ["qwxz" * 40] * 10, vocab)
    assert err.value.param == "bad_words"
    with pytest.raises(InvalidFieldError):
        token_sequences(tok, ["model"], 3)  # ids past a (made-up) vocabulary


@pytest.mark.parametrize("rows,vocab", [(1, 9), (6, 40), (11, 130)])
def test_sampler_bans_on_their_rows_only(rows, vocab):
    logits = torch.randn(rows, vocab) * 3
    top = logits.argmax(-1)
    params = [SamplingParams(temperature=0) for _ in range(rows)]
    banned_rows = sorted(random.sample(range(rows), k=max(1, rows // 2)))
    for r in banned_rows:  # ban the greedy token, and another one only after token 3
        params[r].bad_words_token_ids = [[int(top[r])], [3, int((top[r] + 1) % vocab)]]
    outputs = [[random.randrange(vocab), 3] for _ in range(rows)]
    bans = batch_bans(params, outputs)

    def batch():
        full = lambda v, dt: torch.full((rows,), v, dtype=dt)  # noqa: E731
        return SamplingBatch(full(0.0, torch.float32), full(1.0, torch.float32), full(0, torch.int64),
                             full(0.0, torch.float32), full(1, torch.int64), full(2, torch.int64), all_greedy=True,
                             max_logprobs=1)

    b = batch()
    b.ban_rows, b.ban_ids = torch.tensor(bans[0]), torch.tensor(bans[1])
    out, plain = sample(logits.clone(), b), sample(logits.clone(), batch())
    raw = torch.log_softmax(logits, -1)
    for r in range(rows):
        if r in banned_rows:
            masked = logits[r].clone()
            masked[[int(top[r]), int((top[r] + 1) % vocab)]] = float("-inf")
            assert int(out.token_ids[r]) == int(masked.argmax())
            assert torch.allclose(out.logprobs[r], raw[r, out.token_ids[r]])  # logprobs stay the model's
        else:
            assert int(out.token_ids[r]) == int(plain.token_ids[r])
            assert torch.equal(out.top_logprobs[r], plain.top_logprobs[r])


@pytest.fixture(scope="module")
def llm(tiny_engine):
    return tiny_engine()


def _greedy(max_tokens=24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _round_trip(tok, ids: list[int]) -> str | None:
    """The word that tokenizes back to exactly `ids` (and has no leading blank), or None."""
    word = tok.decode(ids)
    ok = word.strip() and word == word.lstrip() and tok.encode(word, add_special_tokens=False) == ids
    return word if ok else None


def _prompts(vocab: int, n: int = 6) -> list[dict]:
    rng = random.Random(random.randrange(1 << 30))
    return [{"prompt_token_ids": [rng.randrange(min(vocab, 400)) for _ in range(rng.randint(3, 12))]}
            for _ in range(n)]


def test_banned_words_never_appear_where_they_otherwise_would(llm):
    tok = llm.engine.tokenizer
    singles = pairs = []
    while not (singles and pairs):  # fresh prompts until their free outputs hold a word of each width
        prompts = _prompts(llm.engine.model_config.vocab_size)
        free = [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy())]
        cases = []  # (prompt index, word, where it starts in the free output, its width in tokens)
        for p, ids in enumerate(free):
            for width in (1, 2):
                for i in range(len(ids) - width):
                    word = _round_trip(tok, ids[i:i + width])
                    if word is not None:
                        cases.append((p, word, i, width))
                        break
        singles = [c for c in cases if c[3] == 1]
        pairs = [c for c in cases if c[3] == 2 and c[0] != (singles[0][0] if singles else -1)]
    chosen = {c[0]: c for c in [singles[0], pairs[0]]}
    params = [_greedy(bad_words=[chosen[p][1]]) if p in chosen else _greedy() for p in range(len(prompts))]
    banned = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    for p, (_, word, i, width) in chosen.items():
        seqs = token_sequences(tok, [word], llm.engine.model_config.vocab_size)
        assert not any(contains(banned[p], s) for s in seqs), (word, banned[p])
        first = min(j for j in range(len(free[p])) if any(free[p][j:j + len(s)] == s for s in seqs))
        # everything before the ban is unchanged; a pair's first token (its prefix) is still written
        assert banned[p][:first + width - 1] == free[p][:first + width - 1], word
        assert banned[p][first + width - 1] != free[p][first + width - 1]
    for p in set(range(len(prompts))) - set(chosen):  # rows without bad words, in the same batches
        assert banned[p] == free[p]


def test_same_bans_with_speculative_decoding(tiny_engine, tiny_dirs):
    """n-gram drafts are verified under the bans (rows with drafts count them as generated)."""
    model = str(tiny_dirs("spec"))
    plain = tiny_engine(model=model)
    tok = plain.engine.tokenizer
    words = []
    while not words:  # words of one and two tokens from the free outputs (bytes past ASCII do not round-trip)
        prompts = _prompts(300, 4)
        free = [o.outputs[0].token_ids for o in plain.generate(prompts, _greedy(40))]
        for ids in free:
            for width in (1, 2):
                found = [w for i in range(4, len(ids) - width) if (w := _round_trip(tok, ids[i:i + width]))]
                words += found[:1]
    params = _greedy(40, bad_words=words)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    spec = tiny_engine(model=model, spec="ngram", spec_k=3)
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params)]
    assert got == want
    assert spec.engine.spec.stats.num_drafts > 0


@pytest.mark.parametrize("words", ["model", [""], ["ok", "  "], [3], ["x"] * 129, [["x"]]])
def test_bad_input_names_the_field(words):
    with pytest.raises(InvalidFieldError) as err:
        SamplingParams(bad_words=words)
    assert err.value.param == "bad_words"


@pytest.fixture(scope="module")
def server(tiny_dirs):
    from server.conftest import start_server

    running, stop = start_server(tiny_dirs("tiny"))
    yield running
    stop()


def test_through_the_api(server):
    """vLLM's extra field on chat and completions; a bad value is a 400 naming it."""
    msg = [{"role": "user", "content": "hi"}]
    with httpx.Client(base_url=server.url, timeout=120) as c:
        for path, body in (("/v1/completions", {"prompt": "The quick"}), ("/v1/chat/completions", {"messages": msg})):
            r = c.post(path, json=dict(body, max_tokens=4, bad_words=["a", " the"]))
            assert r.status_code == 200, r.text
        for bad in ("word", [""], ["x"] * 129, [1], ["qwxz" * 300]):
            r = c.post("/v1/chat/completions", json={"messages": msg, "max_tokens": 4, "bad_words": bad})
            assert r.status_code == 400 and r.json()["error"]["param"].startswith("bad_words"), (bad, r.text)
