"""Prompt logprobs through the API, with the official openai client: completions' echo with logprobs
(the prompt's logprobs first, as vLLM's), vLLM's `prompt_logprobs` on completions and chat, their
values against transformers' log-softmax, and bad values refused with an OpenAI-style 400."""

from __future__ import annotations

import functools

import httpx
import pytest
import torch

PROMPT = "The quick brown fox jumps over the lazy dog, twice."
MODEL = "tiny-0-0"
BOUND = 1e-4  # fp32 against float64 (tests/engine/test_prompt_logprobs.py checks every row closely)


@functools.lru_cache(maxsize=4)
def _hf(model_dir: str):
    import transformers

    return transformers.Qwen3_5ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float64).eval()


@torch.no_grad()
def hf_logprobs(model_dir: str, ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(_hf(model_dir)(input_ids=torch.tensor([ids])).logits[0], -1)


def _ids(server, text: str) -> list[int]:
    return httpx.post(server.url + "/tokenize", json={"prompt": text}).json()["tokens"]


def test_echo_with_logprobs(openai_client, server):
    ids = _ids(server, PROMPT)
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    r = openai_client.completions.create(echo=True, **kw)
    plain = openai_client.completions.create(**kw)
    choice, out = r.choices[0], plain.choices[0]
    assert choice.text == PROMPT + out.text
    lp, n = choice.logprobs, len(ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    tok = _hf_tokenizer(server.model_dir)
    assert lp.tokens[:n] == [tok.decode([t], skip_special_tokens=False, clean_up_tokenization_spaces=False) for t in ids]
    # values by token id (byte-level tokens that decode alike would share one key of top_logprobs)
    by_id = openai_client.completions.create(echo=True, **dict(kw, extra_body={"ignore_eos": True,
                                                                             "return_tokens_as_token_ids": True}))
    ref, idl = hf_logprobs(server.model_dir, ids), by_id.choices[0].logprobs
    for p in range(1, n):
        assert idl.tokens[p] == f"token_id:{ids[p]}"
        assert idl.token_logprobs[p] == pytest.approx(float(ref[p - 1, ids[p]]), abs=BOUND), p
        top = idl.top_logprobs[p]
        assert idl.tokens[p] in top and 2 <= len(top) <= 3
        best = ref[p - 1].topk(2)
        for rank in range(2):
            key = f"token_id:{int(best.indices[rank])}"
            assert top[key] == pytest.approx(float(best.values[rank]), abs=BOUND), (p, key)
    assert lp.text_offset[:n] == sorted(lp.text_offset[:n]) and lp.text_offset[n] == len(PROMPT)
    # the output's part is the plain request's
    assert lp.tokens[n:] == out.logprobs.tokens
    assert lp.token_logprobs[n:] == pytest.approx(out.logprobs.token_logprobs, abs=1e-5)
    # vLLM also returns the prompt logprobs themselves on the choice
    plps = choice.model_extra["prompt_logprobs"]
    assert len(plps) == n and plps[0] is None
    assert plps[1][str(ids[1])]["logprob"] == pytest.approx(idl.token_logprobs[1], abs=1e-6)
    # streamed: the first chunk carries the prompt's logprobs, the chunks together the same lists
    chunks = list(openai_client.completions.create(echo=True, stream=True, **kw))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == lp.tokens
    assert chunks[0].choices[0].logprobs.token_logprobs[0] is None
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text


@functools.lru_cache(maxsize=2)
def _hf_tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _check_prompt_logprobs(plps: list, ids: list[int], top_n: int, ref: torch.Tensor) -> None:
    assert len(plps) == len(ids) and plps[0] is None
    for p in range(1, len(ids)):
        entry = plps[p]
        assert list(entry)[0] == str(ids[p])
        assert all(set(v) == {"logprob", "rank", "decoded_token"} for v in entry.values())
        assert sorted(v["rank"] for k, v in entry.items() if k != str(ids[p]) or v["rank"] <= top_n)[:top_n] == \
            list(range(1, top_n + 1))
        for k, v in entry.items():
            assert v["logprob"] == pytest.approx(float(ref[p - 1, int(k)]), abs=BOUND), (p, k)


def test_completions_prompt_logprobs_field(openai_client, server):
    ids = _ids(server, PROMPT)
    r = openai_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0,
                                         extra_body={"prompt_logprobs": 3})
    assert r.choices[0].logprobs is None
    _check_prompt_logprobs(r.choices[0].model_extra["prompt_logprobs"], ids, 3, hf_logprobs(server.model_dir, ids))
    plain = openai_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
    assert "prompt_logprobs" not in (plain.choices[0].model_extra or {})


def test_chat_prompt_logprobs_field(openai_client, server):
    messages = [{"role": "user", "content": PROMPT}]
    r = openai_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                              extra_body={"prompt_logprobs": 1, "return_token_ids": True})
    ids = r.model_extra["prompt_token_ids"]
    assert len(ids) == r.usage.prompt_tokens
    _check_prompt_logprobs(r.model_extra["prompt_logprobs"], ids, 1, hf_logprobs(server.model_dir, ids))


BAD = [
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": -2}, "must be a positive value or -1"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, "greater than max allowed: 20"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": -1}, "greater than max allowed: 20"),  # -1: the vocabulary
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}, "not available when `stream=True`"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": "all"}, "valid integer"),
    ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 21}, "max allowed: 20"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": -5},
     "must be a positive value or -1"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 99},
     "greater than max allowed: 20"),
]


@pytest.mark.parametrize("path,body,fragment", BAD)
def test_bad_prompt_logprobs(server, path, body, fragment):
    r = httpx.post(server.url + path, json=dict(body, max_tokens=2), timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == 400 and err["type"] == "BadRequestError"
    assert fragment in err["message"] and err["param"] in ("prompt_logprobs", "logprobs"), err


def test_bad_prompt_logprobs_through_the_client(openai_client):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        openai_client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"prompt_logprobs": 50})
    assert "greater than max allowed" in str(e.value)
