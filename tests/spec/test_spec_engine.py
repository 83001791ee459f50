"""Speculative decoding in the engine: greedy output identical to no speculation (MTP, n-gram,
auto; k = 1, 3, 5) under chunked prefill, quantized caches, preemption and stop strings; the
acceptance the fitted fixture reaches."""

from __future__ import annotations

import random

import pytest
import torch

from qv import LLM, SamplingParams
from qv.config import ModelConfig
from qv.model.cache import kv_bytes_per_block


def _prompts(seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for n in (3, 9, 17, 40):
        items = [rng.randrange(1, 64) for _ in range(rng.randrange(4, 10))]
        out.append({"prompt_token_ids": (items * 4)[:n]})  # lists the fitted target continues
    out.append({"prompt_token_ids": [rng.randrange(300) for _ in range(33)]})  # and free text
    return out


def _run(model_dir, prompts, params, **levers):
    llm = LLM(model=model_dir, **levers)
    return [o.outputs[0] for o in llm.generate(prompts, params)], llm


def _assert_same(outs, base, what):
    for i, (a, b) in enumerate(zip(outs, base)):
        assert a.token_ids == b.token_ids, f"{what}: prompt {i} differs"
        assert a.text == b.text and a.finish_reason == b.finish_reason, f"{what}: prompt {i}"


@pytest.fixture(scope="module")
def baseline(fitted_dir):
    seed = random.randrange(1 << 30)
    prompts = _prompts(seed)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    base, _ = _run(fitted_dir, prompts, params)
    return prompts, params, base


@pytest.mark.parametrize("mode,k", [("mtp", 1), ("mtp", 3), ("mtp", 5), ("ngram", 3), ("auto", 3)])
def test_greedy_identical_with_speculation(fitted_dir, baseline, mode, k):
    prompts, params, base = baseline
    outs, llm = _run(fitted_dir, prompts, params, spec=mode, spec_k=k)
    _assert_same(outs, base, f"spec={mode} k={k}")
    st = llm.engine.spec.stats
    assert st.num_accepted_tokens > 0, "no draft was accepted: the identity would hold trivially"


def test_chunked_prefill_quantized_caches_and_preemption(fitted_dir, baseline):
    prompts, params, base = baseline
    outs, _ = _run(fitted_dir, prompts, params, spec="auto", spec_k=3, max_num_batched_tokens=7)
    _assert_same(outs, base, "chunked prefill (budget 7)")
    ref_q, _ = _run(fitted_dir, prompts, params, kv_dtype="int8", gdn_state_dtype="int16")
    outs_q, _ = _run(fitted_dir, prompts, params, kv_dtype="int8", gdn_state_dtype="int16", spec="mtp", spec_k=3)
    _assert_same(outs_q, ref_q, "int8 KV + int16 state")
    per_block = kv_bytes_per_block(ModelConfig.from_dir(fitted_dir), 16, torch.float32, extra_layers=1)
    outs_p, llm = _run(fitted_dir, prompts, params, spec="mtp", spec_k=3, block_size=16, kv_cache_bytes=14 * per_block)
    assert llm.engine.scheduler.num_preemptions > 0
    _assert_same(outs_p, base, "under preemption")


def test_stop_string_inside_accepted_run(fitted_dir, baseline):
    prompts, _, base = baseline
    i = max(range(len(base)), key=lambda j: len(base[j].text))
    text = base[i].text
    stop = next(text[j:j + 2] for j in range(6, len(text) - 2) if "\ufffd" not in text[j:j + 2])
    params = SamplingParams(temperature=0, max_tokens=40, stop=[stop], ignore_eos=True)
    plain, _ = _run(fitted_dir, [prompts[i]], params)
    outs, llm = _run(fitted_dir, [prompts[i]], params, spec="ngram", spec_k=5)
    assert plain[0].finish_reason == "stop" and plain[0].text == text[:text.index(stop)]
    _assert_same(outs, plain, "stop string")
    assert llm.engine.spec.stats.num_accepted_tokens > 0


def test_acceptance_lengths(fitted_dir):
    rng = random.Random()
    lists = [[rng.randrange(1, 64) for _ in range(rng.randrange(5, 10))] for _ in range(4)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    _, ng = _run(fitted_dir, [{"prompt_token_ids": items * 2} for items in lists], params, spec="ngram", spec_k=3)
    assert ng.engine.spec.stats.mean_acceptance_length >= 2.5, ng.engine.spec.stats
    free = [{"prompt_token_ids": [rng.randrange(300) for _ in range(12)]} for _ in range(4)]
    _, mtp = _run(fitted_dir, free + [{"prompt_token_ids": items * 3} for items in lists], params, spec="mtp",
                  spec_k=3)
    assert mtp.engine.spec.stats.mean_acceptance_length >= 2.0, mtp.engine.spec.stats
