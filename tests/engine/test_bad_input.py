"""Bad requests get clear errors naming the cause, and the engine keeps serving the others."""

from __future__ import annotations

import asyncio
import re

import pytest

from qv import SamplingParams
from qv.config import ConfigError, EngineConfig
from qv.engine.async_engine import AsyncLLMEngine
from qv.engine.request import InvalidRequestError


@pytest.mark.parametrize("kwargs,words", [
    (dict(max_tokens=0), "max_tokens must be at least 1"),
    (dict(max_tokens=-3), "max_tokens must be at least 1"),
    (dict(stop=5), "stop must be a string or a list of strings"),
    (dict(stop=["ok", 3]), "stop must be a string or a list of strings"),
    (dict(stop=[""]), "empty string"),
    (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(top_k=-5), "top_k"),
    (dict(n=0), "n must be at least 1"),
    (dict(min_tokens=9, max_tokens=3), "min_tokens"),
    (dict(stop_token_ids=["a"]), "stop_token_ids"),
    (dict(repetition_penalty=0), "repetition_penalty"),
])
def test_bad_sampling_params(kwargs, words):
    with pytest.raises(InvalidRequestError, match=words):
        SamplingParams(**kwargs)


def test_unknown_sampling_field():
    with pytest.raises(InvalidRequestError, match="unknown SamplingParams field.*top_q"):
        SamplingParams.from_dict({"temperature": 1.0, "top_q": 0.5})
    with pytest.raises(TypeError):
        SamplingParams(top_q=0.5)


def test_bad_levers():
    with pytest.raises(ConfigError, match="kv_dtype"):
        EngineConfig.from_env(environ={}, kv_dtype="int4")
    with pytest.raises(ConfigError, match="QV_MAX_NUM_SEQS"):
        EngineConfig.from_env(environ={"QV_MAX_NUM_SEQS": "many"})
    with pytest.raises(ConfigError, match="unknown engine option.*max_seqs"):
        EngineConfig.from_env(environ={}, max_seqs=3)


def test_prompt_errors_and_engine_keeps_serving(tiny_engine):
    llm = tiny_engine(max_model_len=64)
    ok = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(InvalidRequestError, match="maximum context length is 64 tokens.*70 input tokens"):
        llm.generate({"prompt_token_ids": [1] * 70}, ok)
    with pytest.raises(InvalidRequestError, match=r"60 \+ 10 = 70 > 64"):
        llm.generate({"prompt_token_ids": [1] * 60}, SamplingParams(max_tokens=10))
    for bad in (10**9, -1, 2**70, 1.5, "7", None):  # the message names the offending id
        with pytest.raises(InvalidRequestError, match=rf"token id {re.escape(repr(bad))} is outside the vocabulary"):
            llm.generate({"prompt_token_ids": [1, 2, bad, 3]}, ok)
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate({"prompt_token_ids": []}, ok)
    with pytest.raises(InvalidRequestError, match="a prompt is a string or a dict"):
        llm.generate([42], ok)
    assert len(llm.generate("hello", ok)[0].outputs[0].token_ids) == 4
    # max_tokens=None fills the context
    out = llm.generate({"prompt_token_ids": [1] * 60}, SamplingParams(max_tokens=None, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"


def test_a_request_is_checked_once_and_its_params_are_not_edited(tiny_engine, monkeypatch):
    """check_request returns the normalized request (bad words resolved, max_tokens filled) and leaves
    the caller's params as they were; add_request of a CheckedRequest does not check it again."""
    import dataclasses

    from qv.engine import engine as engine_module
    from qv.engine.request_check import CheckedRequest

    llm = tiny_engine(max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=None, bad_words=["hello"])
    before = dataclasses.asdict(params)
    checked = llm.engine.check_request([5, 6, 7], params)
    assert dataclasses.asdict(params) == before and params.bad_words_token_ids is None
    assert isinstance(checked, CheckedRequest) and checked.max_tokens == 61 and checked.params.bad_words_token_ids
    assert checked.params is not params and checked.prompt_token_ids == [5, 6, 7]
    calls = []
    real = engine_module.check_request
    monkeypatch.setattr(engine_module, "check_request", lambda *a: calls.append(a) or real(*a))
    llm.engine.add_request("r", checked)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert calls == []
    llm.engine.add_request("s", [5, 6, 7], params)  # ids and params: checked here, once
    assert len(calls) == 1


def test_async_engine_errors_abort_and_serving(tiny_dirs):
    engine = AsyncLLMEngine(EngineConfig.from_env(environ={}, model=str(tiny_dirs("tiny")), max_model_len=64))

    async def collect(rid, ids, params):
        outs = [o async for o in engine.generate(rid, ids, params)]
        return outs[-1]

    async def scenario():
        with pytest.raises(InvalidRequestError, match="maximum context length"):
            await collect("big", [1] * 100, SamplingParams(max_tokens=4))
        # leaving an iterator early aborts the request and frees its blocks
        gen = engine.generate("early", [5, 6, 7], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
        await gen.__anext__()
        await gen.aclose()
        good = await asyncio.gather(*[collect(f"r{i}", [i + 1, 2, 3], SamplingParams(temperature=0, max_tokens=6))
                                      for i in range(4)])
        return good

    try:
        good = asyncio.run(scenario())
        assert all(o.finished and len(o.outputs[0].token_ids) <= 6 for o in good)
        for _ in range(50):  # the abort is applied by the engine thread
            if engine.stats().num_running == 0:
                break
            asyncio.run(asyncio.sleep(0.05))
        assert engine.stats().num_running == 0 and engine.engine.blocks.num_free == engine.engine.blocks.num_blocks
        assert engine.healthy
    finally:
        engine.shutdown()
