"""4-bit weights through the engine on the GPU: 4 layers of the 27B shapes (3 GDN + 1 attention), random
GPTQ-Int4 / AWQ weights (group 128), bf16 activations, int8 KV, decode through CUDA graphs, under the default
(Triton) chain against the reference kernels (fp32, the same codes). Greedy tokens must agree except across a
near tie of the oracle's logits, and chosen-token logprobs within 5e-2 or twice what the GPTQ-Int8 weights'
own bf16 run moves them on the same prompts, whichever is more."""

from __future__ import annotations

import random

import pytest
import torch
from shapes_27b import write_27b_config
from test_sm70_engine_gpu import LOGPROB_BOUND, _assert_agree, _worst_logprob_error

from qv import LLM, SamplingParams
from qv.kernels.linear import GPTQWeight

pytestmark = pytest.mark.gpu
LEVERS = dict(load_format="random", kv_dtype="int8", max_model_len=4096, max_num_seqs=8, kv_cache_bytes=1 << 30,
              max_num_batched_tokens=1024, device="cuda", dtype="bfloat16")


def _generate(model_dir, prompts, params, check_bits=None, **levers):
    llm = LLM(model=model_dir, **dict(LEVERS, **levers))
    if check_bits is not None:
        w = llm.engine.runner.model.layers[0].mlp.down.weight
        assert isinstance(w, GPTQWeight) and w.bits == check_bits
    outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    del llm
    torch.cuda.empty_cache()
    return outs


@pytest.mark.parametrize("quantization", ["gptq-int4", "awq"])
def test_int4_triton_chain_matches_reference_on_27b_shapes(tmp_path, quantization):
    model_dir = write_27b_config(tmp_path, 4, 4096)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(248000) for _ in range(n)]} for n in (1, 17, 300, 1500)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    int8_ref = _generate(model_dir, prompts, params, kernels="reference", quantization="gptq-int8", cuda_graphs=False)
    int8 = _generate(model_dir, prompts, params, kernels="triton", quantization="gptq-int8")
    bound = max(LOGPROB_BOUND, 2 * _worst_logprob_error(int8, int8_ref))
    ref = _generate(model_dir, prompts, params, kernels="reference", quantization=quantization, cuda_graphs=False)
    ours = _generate(model_dir, prompts, params, check_bits=4, kernels="triton", quantization=quantization)
    for i, (a, b) in enumerate(zip(ours, ref)):
        _assert_agree(f"{quantization} prompt {i}", a, b, bound)
