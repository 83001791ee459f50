"""logit_bias and allowed_token_ids: on the sampler's rows that have them only (random logits,
odd shapes), through the engine in one batch with unbiased requests (the tiny model), through the
openai client, and their validation (400 naming the field)."""

from __future__ import annotations

import random

import httpx
import openai
import pytest
import torch

from qv import SamplingParams
from qv.engine.request import InvalidFieldError
from qv.engine.sampler import SamplingBatch, sample, token_bias


def _batch(rows: int, greedy: list[bool]) -> SamplingBatch:
    full = lambda v, dt: torch.full((rows,), v, dtype=dt)  # noqa: E731
    temperature = torch.tensor([0.0 if g else 0.9 for g in greedy], dtype=torch.float32)
    return SamplingBatch(temperature, full(1.0, torch.float32), full(0, torch.int64), full(0.0, torch.float32),
                         torch.arange(rows, dtype=torch.int64) + random.randrange(1 << 40),
                         torch.full((rows,), 3, dtype=torch.int64), all_greedy=all(greedy), max_logprobs=2)


@pytest.mark.parametrize("rows,vocab", [(1, 7), (5, 33), (9, 151)])
def test_sampler_bias_on_its_rows_only(rows, vocab):
    logits = torch.randn(rows, vocab) * 4
    greedy = [random.random() < 0.5 for _ in range(rows)]
    biased_rows = sorted(random.sample(range(rows), k=max(1, rows // 2)))
    forced = {r: random.randrange(vocab) for r in biased_rows}
    params = []
    for r in biased_rows:
        if r % 3 == 0:  # +100 forces a token whatever its logit
            params.append(SamplingParams(logit_bias={str(forced[r]): 100}))
        elif r % 3 == 1:  # allowed_token_ids leaves one token
            params.append(SamplingParams(allowed_token_ids=[forced[r]]))
        else:  # -100 on every token but one
            params.append(SamplingParams(logit_bias={t: -100 for t in range(vocab) if t != forced[r]}))
    b = _batch(rows, greedy)
    b2 = _batch(rows, greedy)
    b2.seeds = b.seeds.clone()
    b2.bias_rows = torch.tensor(biased_rows)
    b2.bias = token_bias(params, vocab, "cpu")
    plain = sample(logits.clone(), b)
    out = sample(logits.clone(), b2)
    raw = torch.log_softmax(logits, -1)
    for r in range(rows):
        if r in forced:
            assert int(out.token_ids[r]) == forced[r]
            assert torch.allclose(out.logprobs[r], raw[r, forced[r]])  # logprobs stay the model's
        else:  # same token, same logprobs: nothing touched this row
            assert int(out.token_ids[r]) == int(plain.token_ids[r])
            assert torch.equal(out.top_logprobs[r], plain.top_logprobs[r])


def test_minus_100_bans_the_greedy_token():
    logits = torch.randn(4, 50)
    top = logits.argmax(-1)
    b = _batch(4, [True] * 4)
    b.bias_rows = torch.tensor([1, 3])
    b.bias = token_bias([SamplingParams(logit_bias={int(top[1]): -100}),
                         SamplingParams(logit_bias={int(top[3]): -100.0})], 50, "cpu")
    ids = sample(logits, b).token_ids
    assert ids[0] == top[0] and ids[2] == top[2]
    second = logits.topk(2).indices[:, 1]
    assert ids[1] == second[1] and ids[3] == second[3]


@pytest.fixture(scope="module")
def llm(tiny_engine):
    return tiny_engine()


def test_engine_batch_with_and_without_bias(llm):
    vocab = llm.engine.model_config.vocab_size
    prompts = [{"prompt_token_ids": [random.randrange(vocab) for _ in range(random.randint(3, 12))]} for _ in range(5)]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = llm.generate(prompts, greedy)
    token = random.randrange(vocab)
    banned = alone[2].outputs[0].token_ids[0]
    allowed = random.sample(range(vocab), 3)
    params = [greedy,
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={str(token): 100}),
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={banned: -100}),
              SamplingParams(temperature=0.8, seed=7, max_tokens=6, ignore_eos=True, allowed_token_ids=allowed),
              greedy]
    together = llm.generate(prompts, params)
    assert together[1].outputs[0].token_ids == [token] * 6
    assert together[2].outputs[0].token_ids[0] != banned
    assert set(together[3].outputs[0].token_ids) <= set(allowed)
    for i in (0, 4):  # the unbiased rows of the same batch are what they are alone
        assert together[i].outputs[0].token_ids == alone[i].outputs[0].token_ids


@pytest.mark.parametrize("kw,field", [
    ({"logit_bias": {"abc": 1}}, "logit_bias"), ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 100.5}}, "logit_bias"), ({"logit_bias": {"5": -101}}, "logit_bias"),
    ({"logit_bias": {"5": float("nan")}}, "logit_bias"), ({"logit_bias": {"5": True}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"), ({"logit_bias": [1]}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"), ({"allowed_token_ids": [-3]}, "allowed_token_ids"),
])
def test_validate_names_the_field(kw, field):
    with pytest.raises(InvalidFieldError) as err:
        SamplingParams(**kw)
    assert err.value.param == field


@pytest.fixture(scope="module")
def client(tiny_dirs):
    from server.conftest import start_server

    running, stop = start_server(tiny_dirs("tiny"))
    yield running, openai.OpenAI(base_url=running.v1, api_key="unused", max_retries=0, timeout=120)
    stop()


def test_through_the_openai_client(client):
    running, oa = client
    model = oa.models.list().data[0].id
    token = httpx.post(running.url + "/tokenize", json={"prompt": "hello"}, timeout=30).json()["tokens"][0]
    text = httpx.post(running.url + "/detokenize", json={"tokens": [token] * 4}, timeout=30).json()["prompt"]
    r = oa.completions.create(model=model, prompt="hello there", max_tokens=4, temperature=0,
                              logit_bias={str(token): 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].text == text
    r = oa.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                   temperature=0, logit_bias={str(token): 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == text
    allowed = random.sample(range(200), 2)
    r = oa.completions.create(model=model, prompt="hi", max_tokens=5, temperature=1.0, seed=3,
                              extra_body={"ignore_eos": True, "allowed_token_ids": allowed, "return_token_ids": True})
    assert set(r.choices[0].model_extra["token_ids"]) <= set(allowed)


@pytest.mark.parametrize("bias", [{"x": 1}, {"3": 500}, {"99999999": 1}, {str(i): 0 for i in range(301)},
                                  {"3": "a"}, {"3": None}])
def test_bad_logit_bias_is_a_400(client, bias):
    running, oa = client
    model = oa.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as err:
        oa.completions.create(model=model, prompt="hi", max_tokens=2, logit_bias=bias)
    assert err.value.status_code == 400 and err.value.body["param"].startswith("logit_bias"), err.value.body
    with pytest.raises(openai.BadRequestError) as err:
        oa.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                   logit_bias=bias)
    assert err.value.body["param"].startswith("logit_bias"), err.value.body
    with pytest.raises(openai.BadRequestError) as err:
        oa.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                   extra_body={"allowed_token_ids": [10 ** 9]})
    assert err.value.body["param"] == "allowed_token_ids"
