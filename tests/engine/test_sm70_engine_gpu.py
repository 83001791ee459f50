"""The sm70 chain end to end on the H200 (m8n8k4 MMAs run there, emulated): the engine under kernels=sm70
in fp16 (Volta has no bf16) against the reference kernels on the tiny GPTQ fixtures, and against the
default chain on a 27B-shaped model of a few layers. Greedy tokens must agree except across a near tie of
the oracle's logits (after which the two continue from different tokens), and the chosen tokens' logprobs
within the fp16 bound, or within twice what the default chain's own fp16 run moves them where that is more
(the random tiny models amplify fp16 rounding; docs/VALIDATION.md gives the measured errors)."""

from __future__ import annotations

import random

import pytest
import torch
from shapes_27b import write_27b_config

from qv import SamplingParams
from qv.errors import StartupError
from qv.model.quantize import quantize_checkpoint

pytestmark = pytest.mark.gpu

LOGPROB_BOUND = 5e-2  # fp16 activations through every layer (docs/VALIDATION.md, "Volta")
TIE = 5e-2  # a divergence is allowed only where the oracle's top two logprobs are this close


def _assert_agree(name: str, ours, oracle, bound: float = LOGPROB_BOUND) -> None:
    for j, (a, b) in enumerate(zip(ours.token_ids, oracle.token_ids)):
        top = oracle.logprobs[j]
        if a != b:
            margin = top[b].logprob - top[a].logprob if a in top else float("inf")
            assert margin < TIE, f"{name}: token {j}: sm70 {a}, oracle {b} (oracle's margin {margin:.2e})"
            return
        err = abs(ours.logprobs[j][a].logprob - top[a].logprob)
        assert err < bound, f"{name}: token {j} logprob off by {err:.3e} (bound {bound:.3e})"
    assert len(ours.token_ids) == len(oracle.token_ids)


def _worst_logprob_error(outs, oracle) -> float:
    """The largest chosen-token logprob error over the tokens before each output's first divergence."""
    worst = 0.0
    for ours, ref in zip(outs, oracle):
        for j, (a, b) in enumerate(zip(ours.token_ids, ref.token_ids)):
            if a != b:
                break
            worst = max(worst, abs(ours.logprobs[j][a].logprob - ref.logprobs[j][a].logprob))
    return worst


def _generate(tiny_engine, model_dir, prompts, params, **levers):
    levers.setdefault("kv_cache_bytes", 256 << 20)
    llm = tiny_engine(model=model_dir, device="cuda", dtype="float16", **levers)
    outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    del llm
    torch.cuda.empty_cache()
    return outs


@pytest.mark.parametrize("preset", ["tiny", "gqa1", "gqa3"])
def test_sm70_greedy_equals_reference_on_tiny_gptq(tiny_engine, tiny_dirs, tmp_path, preset):
    folder = str(quantize_checkpoint(tiny_dirs(preset), tmp_path / "gptq", group_size=16))
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(300) for _ in range(n)]} for n in (5, 37, 130, 300)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    ref = _generate(tiny_engine, folder, prompts, params, kernels="reference", cuda_graphs=False)
    bound = max(LOGPROB_BOUND, 2 * _worst_logprob_error(_generate(tiny_engine, folder, prompts, params,
                                                                  kernels="triton"), ref))
    # gqa3's head dim 16 is below what the m8n8k4 attention takes (32-256): its fp32 fallback runs eagerly
    graphs = preset != "gqa3"
    ours = _generate(tiny_engine, folder, prompts, params, kernels="sm70", max_num_batched_tokens=128,
                     cuda_graphs=graphs)
    for i, (a, b) in enumerate(zip(ours, ref)):
        _assert_agree(f"{preset} prompt {i}", a, b, bound)
    if not graphs:
        with pytest.raises(StartupError, match=r"head dim 16.*cannot run inside a CUDA graph capture"):
            _generate(tiny_engine, folder, prompts, params, kernels="sm70")


@pytest.mark.parametrize("quantization", ["gptq-int8", "gptq-int4", "awq"])
def test_sm70_matches_default_chain_on_27b_shapes(tiny_engine, tmp_path, quantization):
    """4 layers of the 27B (3 GDN + 1 attention), random GPTQ-Int8 / GPTQ-Int4 / AWQ weights, int8 KV: sm70
    against the default chain at fp16, prompts past one prefill chunk, decode through each chain's CUDA graphs."""
    model_dir = write_27b_config(tmp_path, 4, 4096)
    levers = dict(load_format="random", quantization=quantization, kv_dtype="int8", max_model_len=4096,
                  max_num_seqs=8, kv_cache_bytes=1 << 30, max_num_batched_tokens=1024)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(248000) for _ in range(n)]} for n in (17, 300, 1500)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    default = _generate(tiny_engine, model_dir, prompts, params, kernels="triton", **levers)
    ours = _generate(tiny_engine, model_dir, prompts, params, kernels="sm70", **levers)
    for i, (a, b) in enumerate(zip(ours, default)):
        _assert_agree(f"27B shapes prompt {i}", a, b)
