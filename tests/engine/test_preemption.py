"""Preemption by recompute under a KV budget that fits two of eight requests at a time."""

from __future__ import annotations

import random

import torch

from qv import SamplingParams
from qv.config import ModelConfig
from qv.model.cache import kv_bytes_per_block

BLOCK = 16


def _budget(model_dir: str, blocks: int) -> int:
    return blocks * kv_bytes_per_block(ModelConfig.from_dir(model_dir), BLOCK, torch.float32)


def test_eight_requests_two_at_a_time(tiny_engine, tiny_dirs):
    model_dir = str(tiny_dirs("tiny"))
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(300) for _ in range(rng.randrange(20, 50))]} for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    free = tiny_engine(model=model_dir, block_size=BLOCK).generate(prompts, params)
    # each request needs <= 82 tokens = 6 blocks; 12 blocks hold two at a time
    tight = tiny_engine(model=model_dir, block_size=BLOCK, kv_cache_bytes=_budget(model_dir, 12),
                        max_num_batched_tokens=64)
    out = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0, "the budget was meant to force preemption"
    for a, b in zip(out, free):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].finish_reason == "length"
    assert tight.engine.blocks.num_free == tight.engine.blocks.num_blocks  # nothing leaked


def test_request_that_cannot_fit_alone_fails_others_complete(tiny_engine, tiny_dirs):
    model_dir = str(tiny_dirs("tiny"))
    llm = tiny_engine(model=model_dir, block_size=BLOCK, kv_cache_bytes=_budget(model_dir, 8))  # 128 tokens
    small = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    huge = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(1, 30))}, {"prompt_token_ids": list(range(2, 40))},
               {"prompt_token_ids": list(range(3, 23))}]
    outs = llm.generate(prompts, [small, huge, small])
    assert outs[1].outputs[0].finish_reason == "error"
    assert "KV cache" in outs[1].error and "tokens" in outs[1].error
    for i in (0, 2):
        assert outs[i].outputs[0].finish_reason == "length" and len(outs[i].outputs[0].token_ids) == 16
    # a prompt longer than the whole cache fails at once with the same clear error
    too_long = llm.generate({"prompt_token_ids": [5] * 200}, small)[0]
    assert too_long.outputs[0].finish_reason == "error" and "whole cache holds 128 tokens" in too_long.error
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks
