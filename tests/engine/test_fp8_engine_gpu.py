"""Block-FP8 weights through the engine on the GPU: 4 layers of the 27B shapes (3 GDN + 1 attention), random FP8
weights in Qwen's layout (128x128 blocks, `--quantization fp8`), bf16 activations, int8 KV, decode through
CUDA graphs, under the default (Triton) chain and the sm70 chain against the reference kernels (fp32, the same
e4m3 values). Prompts of 1 to 1500 tokens run every path: the FMA GEMV, widened tensor-core tiles, and W8A8 on
sm_89+ (its activation rounding is why the bound is the larger of 5e-2 and twice what GPTQ-Int8's own bf16 run
moves the chosen-token logprobs). Greedy tokens must agree except across a near tie of the oracle's logits."""

from __future__ import annotations

import random

import pytest
import torch
from shapes_27b import write_27b_config
from test_sm70_engine_gpu import LOGPROB_BOUND, _assert_agree, _worst_logprob_error

from qv import LLM, SamplingParams
from qv.kernels.linear import FP8Weight

pytestmark = pytest.mark.gpu
LEVERS = dict(load_format="random", kv_dtype="int8", max_model_len=4096, max_num_seqs=8, kv_cache_bytes=1 << 30,
              max_num_batched_tokens=1024, device="cuda", dtype="bfloat16")


def _generate(model_dir, prompts, params, check_fp8=False, **levers):
    llm = LLM(model=model_dir, **dict(LEVERS, **levers))
    if check_fp8:
        w = llm.engine.runner.model.layers[0].mlp.down.weight
        assert isinstance(w, FP8Weight) and w.block == (128, 128)
    outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    del llm
    torch.cuda.empty_cache()
    return outs


@pytest.mark.parametrize("kernels,dtype", [("triton", "bfloat16"), ("sm70", "float16")])
def test_fp8_chains_match_reference_on_27b_shapes(tmp_path, kernels, dtype):
    model_dir = write_27b_config(tmp_path, 4, 4096)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(248000) for _ in range(n)]} for n in (1, 17, 300, 1500)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    int8_ref = _generate(model_dir, prompts, params, kernels="reference", quantization="gptq-int8", cuda_graphs=False,
                         dtype=dtype)
    int8 = _generate(model_dir, prompts, params, kernels=kernels, quantization="gptq-int8", dtype=dtype)
    bound = max(LOGPROB_BOUND, 2 * _worst_logprob_error(int8, int8_ref))
    ref = _generate(model_dir, prompts, params, kernels="reference", quantization="fp8", cuda_graphs=False,
                    dtype=dtype)
    ours = _generate(model_dir, prompts, params, check_fp8=True, kernels=kernels, quantization="fp8", dtype=dtype)
    for i, (a, b) in enumerate(zip(ours, ref)):
        _assert_agree(f"fp8 {kernels} prompt {i}", a, b, bound)
