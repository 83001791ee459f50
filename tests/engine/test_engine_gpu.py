"""The engine on the GPU: Triton kernels with captured decode graphs give the reference path's
greedy tokens (fp32), speculation stays exact there, and quantized caches run."""

from __future__ import annotations

import random

import pytest
import torch

from qv import SamplingParams

pytestmark = pytest.mark.gpu


def _prompts(n_prompts: int = 6):
    rng = random.Random(0)
    return [{"prompt_token_ids": [rng.randrange(300) for _ in range(rng.randrange(1, 90))]} for _ in range(n_prompts)]


def _tokens(tiny_engine, model_dir, prompts, params, **levers):
    # an explicit cache size: several test workers share the GPU
    llm = tiny_engine(model=model_dir, device="cuda", kv_cache_bytes=256 << 20, **levers)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)], llm


def test_triton_with_graphs_equals_reference_fp32(tiny_engine, tiny_dirs):
    model_dir = str(tiny_dirs("tiny"))
    prompts = _prompts()
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    ref, _ = _tokens(tiny_engine, model_dir, prompts, params, kernels="reference", dtype="float32", cuda_graphs=False)
    out, llm = _tokens(tiny_engine, model_dir, prompts, params, kernels="triton", dtype="float32", cuda_graphs=True)
    assert llm.engine.runner.graphs is not None, "decode graphs failed to capture (see the log)"
    assert out == ref


def test_speculation_exact_on_gpu(tiny_engine, tmp_path, monkeypatch):
    """Greedy tokens with MTP and n-gram drafts equal speculation off, through the verification graphs and
    the MTP head's graphs (their replays counted)."""
    from qv.engine.cuda_graphs import DecodeGraphs
    from qv.model.tiny import make_tiny
    from qv.spec.fit import fit_mtp_head

    replays = {"decode": 0, "verify": 0, "mtp": 0}
    run, run_mtp = DecodeGraphs.run, DecodeGraphs.run_mtp
    monkeypatch.setattr(DecodeGraphs, "run", lambda self, *a: replays.__setitem__(
        "decode" if self.q == 1 else "verify", replays["decode" if self.q == 1 else "verify"] + 1) or run(self, *a))
    monkeypatch.setattr(DecodeGraphs, "run_mtp", lambda self, *a: replays.__setitem__(
        "mtp", replays["mtp"] + 1) or run_mtp(self, *a))

    model_dir = str(make_tiny(tmp_path / "spec", "spec", seed=3, mtp=True))
    fit_mtp_head(model_dir, steps=200, log=lambda *_: None)
    prompts = _prompts()
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    base, _ = _tokens(tiny_engine, model_dir, prompts, params, kernels="triton", dtype="float32")
    for mode in ("mtp", "ngram"):
        out, llm = _tokens(tiny_engine, model_dir, prompts, params, kernels="triton", dtype="float32", spec=mode,
                           spec_k=3)
        assert out == base, mode
        assert llm.engine.runner.verify_graphs is not None and llm.engine.spec.stats.num_drafts > 0
    assert replays["verify"] > 0 and replays["mtp"] > 0, replays


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16bit_and_quantized_caches_run(tiny_engine, tiny_dirs, dtype):
    model_dir = str(tiny_dirs("tiny"))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    out, llm = _tokens(tiny_engine, model_dir, _prompts(4), params, kernels="triton", dtype=dtype, kv_dtype="int8",
                       gdn_state_dtype="int16")
    assert all(len(t) == 24 for t in out)
    assert torch.cuda.is_available() and llm.engine.runner.graphs is not None
