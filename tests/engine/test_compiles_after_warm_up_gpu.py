"""After start-up's warm-up, serving compiles no Triton kernel: a compile (a second or more) inside a step stalls
every request, and each variant keeps a module in host memory. Triton compiles a variant per class of each
integer argument (1, a multiple of 16, other) and per pointer alignment, so the kernels leave the counts that
change from step to step unspecialized (qv.kernels.triton_utils.jit_per_step)."""

from __future__ import annotations

import random

import pytest

from qv import SamplingParams
from qv.kernels.triton_utils import compiled_variants, jit_kernels, variant_keys


@pytest.mark.gpu
def test_steps_of_new_shapes_after_warm_up_compile_nothing(tiny_engine):
    """1 to 20 sequences at once, prompts of 1 to 300 tokens (chunks beside decodes, rows and sequence counts of
    every class), greedy: no kernel gains a compiled variant after the engine's warm-up."""
    llm = tiny_engine(max_model_len=1024, max_num_batched_tokens=512)  # warmed up at start on CUDA
    before = compiled_variants()
    keys_before = {name: set(variant_keys(fn)) for name, fn in jit_kernels().items()}
    assert sum(before.values()) > 0, "no compiled Triton kernel seen: the count would prove nothing"
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    for n in (1, 2, 16, 17, 20):
        prompts = [{"prompt_token_ids": [rng.randrange(3, 200) for _ in range(rng.choice([1, 16, 17, 64, 100, 300]))]}
                   for _ in range(n)]
        llm.generate(prompts, params)
    grown = {name: (before.get(name, 0), count) for name, count in compiled_variants().items() if count > before.get(name, 0)}
    new_keys = {name: [k for k in variant_keys(fn) if k not in keys_before.get(name, ())]
                for name, fn in jit_kernels().items() if name in grown}
    old_keys = {name: sorted(keys_before.get(name, ())) for name in grown}
    assert not grown, (f"kernels compiled after the warm-up (variants before, after): {grown}; new keys: {new_keys}; "
                       f"the keys compiled before: {old_keys}")
