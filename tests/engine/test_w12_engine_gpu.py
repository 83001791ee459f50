"""W12 attention projections through the engine on the GPU: 4 layers of the 27B shapes with dense bf16 random
weights (q/k/v 5120 -> 12288 + 1024 + 1024 in the attention layer), w12 on against w12 off, decode through
CUDA graphs. Chosen-token logprobs within 5e-2 (the W12 representation error is 5.5e-4 at these shapes, about a
quarter of bf16's own rounding) and greedy tokens equal except across a near tie. The second start reads the
packs from the state directory (the files are not rewritten)."""

from __future__ import annotations

import random

import pytest
import torch
from shapes_27b import write_27b_config
from test_sm70_engine_gpu import LOGPROB_BOUND, _assert_agree, _worst_logprob_error

from qv import LLM, SamplingParams
from qv.kernels.linear import W12Weight

pytestmark = pytest.mark.gpu
LEVERS = dict(load_format="random", kv_dtype="int8", max_model_len=4096, max_num_seqs=8, kv_cache_bytes=1 << 30,
              max_num_batched_tokens=1024, device="cuda", dtype="bfloat16")


def _generate(model_dir, prompts, params, **levers):
    llm = LLM(model=model_dir, **dict(LEVERS, **levers))
    qkv = [p.weight for layer in llm.engine.runner.model.layers if layer.kind == "full_attention"
           for p in layer.mixer.qkv.parts]
    assert all(isinstance(w, W12Weight) == levers["w12"] for w in qkv)
    outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    del llm
    torch.cuda.empty_cache()
    return outs


def test_w12_against_bf16_projections_on_27b_shapes(tmp_path):
    model_dir = write_27b_config(tmp_path, 4, 4096)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(248000) for _ in range(n)]} for n in (1, 17, 300, 1500)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    state = tmp_path / "state"
    bf16 = _generate(model_dir, prompts, params, w12=False, state_dir=str(state))
    w12 = _generate(model_dir, prompts, params, w12=True, state_dir=str(state))
    packs = sorted((state / "w12").rglob("*.safetensors"))
    assert len(packs) == 1  # one attention layer, q/k/v fused
    stamp = packs[0].stat().st_mtime_ns
    again = _generate(model_dir, prompts, params, w12=True, state_dir=str(state))
    assert packs[0].stat().st_mtime_ns == stamp  # read from the cache, not packed again
    print(f"W12 vs bf16 projections: worst chosen-token logprob error {_worst_logprob_error(w12, bf16):.2e}")
    for i, (a, b, c) in enumerate(zip(w12, bf16, again)):
        _assert_agree(f"w12 prompt {i}", a, b, LOGPROB_BOUND)
        assert a.token_ids == c.token_ids
