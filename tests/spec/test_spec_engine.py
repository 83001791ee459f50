"""Speculative decoding in the engine: greedy output identical to no speculation (MTP, n-gram,
auto; k = 1, 3, 5) under chunked prefill, quantized caches, preemption and stop strings; the
acceptance the fitted fixture reaches."""

from __future__ import annotations

import random

import pytest
import torch

from qv import SamplingParams
from qv.config import ModelConfig
from qv.model.cache import kv_bytes_per_block
from qv.model.tiny import PRESETS


CYCLE = PRESETS["spec"]["cycle"]


def model_list(j: int, rotate: int) -> list[int]:
    """One period of the fixture's greedy cycles: ids CYCLE*j .. CYCLE*j + CYCLE-1, rotated. With
    4 <= j < 15 the ids are printable ASCII bytes (the tiny tokenizer's ids 0-255 are the bytes)."""
    ids = list(range(CYCLE * j, CYCLE * (j + 1)))
    return ids[rotate:] + ids[:rotate]


def _prompts(seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = [{"prompt_token_ids": [rng.randrange(300) for _ in range(n)]} for n in (3, 9, 17, 40)]
    out.append({"prompt_token_ids": model_list(rng.randrange(4, 15), rng.randrange(CYCLE)) * 2})
    return out


def _run(tiny_engine, model_dir, prompts, params, **levers):
    llm = tiny_engine(model=model_dir, **levers)
    return [o.outputs[0] for o in llm.generate(prompts, params)], llm


def _assert_same(outs, base, what):
    for i, (a, b) in enumerate(zip(outs, base)):
        assert a.token_ids == b.token_ids, f"{what}: prompt {i} differs"
        assert a.text == b.text and a.finish_reason == b.finish_reason, f"{what}: prompt {i}"


@pytest.fixture(scope="module")
def baseline(tiny_engine, fitted_dir):
    seed = random.randrange(1 << 30)
    prompts = _prompts(seed)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    base, _ = _run(tiny_engine, fitted_dir, prompts, params)
    return prompts, params, base


@pytest.mark.parametrize("mode,k", [("mtp", 1), ("mtp", 3), ("mtp", 5), ("ngram", 3), ("auto", 3)])
def test_greedy_identical_with_speculation(tiny_engine, fitted_dir, baseline, mode, k):
    prompts, params, base = baseline
    outs, llm = _run(tiny_engine, fitted_dir, prompts, params, spec=mode, spec_k=k)
    _assert_same(outs, base, f"spec={mode} k={k}")
    st = llm.engine.spec.stats
    assert st.num_accepted_tokens > 0, "no draft was accepted: the identity would hold trivially"


def test_chunked_prefill_quantized_caches_and_preemption(tiny_engine, fitted_dir, baseline):
    prompts, params, base = baseline
    outs, _ = _run(tiny_engine, fitted_dir, prompts, params, spec="auto", spec_k=3, max_num_batched_tokens=7)
    _assert_same(outs, base, "chunked prefill (budget 7)")
    ref_q, _ = _run(tiny_engine, fitted_dir, prompts, params, kv_dtype="int8", gdn_state_dtype="int16")
    outs_q, _ = _run(tiny_engine, fitted_dir, prompts, params, kv_dtype="int8", gdn_state_dtype="int16", spec="mtp",
                     spec_k=3)
    _assert_same(outs_q, ref_q, "int8 KV + int16 state")
    per_block = kv_bytes_per_block(ModelConfig.from_dir(fitted_dir), 16, torch.float32, extra_layers=1)
    outs_p, llm = _run(tiny_engine, fitted_dir, prompts, params, spec="mtp", spec_k=3, block_size=16,
                       kv_cache_bytes=14 * per_block)
    assert llm.engine.scheduler.num_preemptions > 0
    _assert_same(outs_p, base, "under preemption")


def test_stop_string_inside_accepted_run(tiny_engine, fitted_dir):
    """A stop string produced by the 4th output token: on a list the model repeats, n-gram drafts make
    tokens 2..4 one accepted run, and nothing past the stop may be emitted. (The list is one the model is
    seen to continue: the fitted fixture does not repeat every rotation of every cycle, and a list it
    leaves gives n-gram nothing to draft before the stop.)"""
    from transformers import AutoTokenizer

    rotate = random.randrange(CYCLE)
    lists = [model_list(j, rotate) for j in range(4, 15)]
    probe, _ = _run(tiny_engine, fitted_dir, [{"prompt_token_ids": items * 2} for items in lists],
                    SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    repeated = [items for items, out in zip(lists, probe) if list(out.token_ids) == items[:6]]
    assert repeated, f"the fitted fixture repeats none of the lists at rotation {rotate}"
    prompt = {"prompt_token_ids": repeated[0] * 2}
    tok = AutoTokenizer.from_pretrained(fitted_dir)
    ids = repeated[0]
    before, upto = tok.decode(ids[:3]), tok.decode(ids[:4])
    stop = upto[len(before):]
    assert stop and "\ufffd" not in stop and before.find(stop) == -1, "pick another token"
    params = SamplingParams(temperature=0, max_tokens=40, stop=[stop], ignore_eos=True)
    plain, _ = _run(tiny_engine, fitted_dir, [prompt], params)
    outs, llm = _run(tiny_engine, fitted_dir, [prompt], params, spec="ngram", spec_k=3)
    assert plain[0].finish_reason == "stop" and plain[0].text == before
    _assert_same(outs, plain, "stop string")
    assert llm.engine.spec.stats.num_accepted_tokens > 0


def test_acceptance_lengths(tiny_engine, fitted_dir):
    """n-gram on a list the model repeats, copied twice: >= 2.5 tokens per step at k=3; the fitted
    MTP head on the model's own greedy continuations of random prompts: >= 2.0."""
    rng = random.Random(0)
    lists = [model_list(rng.randrange(4, 15), rng.randrange(CYCLE)) for _ in range(4)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    _, ng = _run(tiny_engine, fitted_dir, [{"prompt_token_ids": items * 2} for items in lists], params, spec="ngram",
                 spec_k=3)
    assert ng.engine.spec.stats.mean_acceptance_length >= 2.5, ng.engine.spec.stats
    free = [{"prompt_token_ids": [rng.randrange(300) for _ in range(12)]} for _ in range(6)]
    _, mtp = _run(tiny_engine, fitted_dir, free, params, spec="mtp", spec_k=3)
    assert mtp.engine.spec.stats.mean_acceptance_length >= 2.0, mtp.engine.spec.stats


@pytest.mark.parametrize("mode", ["mtp", "auto"])
def test_more_sequences_than_spec_max_seqs(tiny_engine, fitted_dir, mode, monkeypatch):
    """Three times more sequences in flight than the speculator's per-position state buffers (the engine
    used to fail with an IndexError past 16): while more than 4 decode, no step verifies (a step mixing
    verification rows with single rows could not replay a CUDA graph); as they finish, the rest
    verify drafts again, every sequence of a step alike. Greedy outputs equal speculation off."""
    _check_three_times_capacity(tiny_engine, fitted_dir, mode, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["mtp", "ngram"])
def test_more_sequences_than_spec_max_seqs_gpu(tiny_engine, fitted_dir, mode, monkeypatch):
    """The same on the GPU: Triton kernels, fp32, decode and verification CUDA graphs (the kernels must not
    write past the 4 per-position state buffers either)."""
    _check_three_times_capacity(tiny_engine, fitted_dir, mode, monkeypatch, device="cuda", kernels="triton",
                                dtype="float32",
                                kv_cache_bytes=256 << 20)


def _check_three_times_capacity(tiny_engine, fitted_dir, mode, monkeypatch, **levers):
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": model_list(rng.randrange(4, 15), rng.randrange(CYCLE)) * 2} for _ in range(12)]
    params = [SamplingParams(temperature=0, max_tokens=6 + 3 * i, ignore_eos=True) for i in range(12)]
    base, _ = _run(tiny_engine, fitted_dir, prompts, params, **levers)
    from qv.engine.runner import ModelRunner
    shapes, prepare = [], ModelRunner.prepare

    def spy(self, plan):
        st = prepare(self, plan)
        shapes.append((len(st.seqs), st.num_spec))
        return st

    monkeypatch.setattr(ModelRunner, "prepare", spy)
    outs, llm = _run(tiny_engine, fitted_dir, prompts, params, spec=mode, spec_k=3, spec_max_seqs=4, **levers)
    _assert_same(outs, base, f"spec={mode} with 12 sequences over 4 verification slots")
    assert llm.engine.spec.stats.num_accepted_tokens > 0
    assert all(n_spec in (0, n) and n_spec <= 4 for n, n_spec in shapes), shapes
    assert any(n > 4 for n, _ in shapes) and any(n_spec for _, n_spec in shapes), shapes
