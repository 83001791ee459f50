"""Engine vs transformers: greedy tokens and logprobs for a batch of mixed-length prompts, under
different token budgets (chunked prefill), sequence caps and alone."""

from __future__ import annotations

import random

import pytest

from engine_oracle import assert_logprob_close, assert_same_greedy, hf_greedy
from qv import SamplingParams

LENGTHS = [1, 2, 17, 64, 65, 130, 211, 300]
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def case(tiny_dirs):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    model_dir = str(tiny_dirs("tiny"))
    prompts = [[rng.randrange(300) for _ in range(n)] for n in LENGTHS]
    refs = [hf_greedy(model_dir, p, MAX_TOKENS) for p in prompts]
    return model_dir, prompts, refs, seed


def _run(tiny_engine, model_dir, prompts, **levers):
    llm = tiny_engine(model=model_dir, **levers)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


@pytest.mark.parametrize("levers", [
    dict(max_num_batched_tokens=64, max_num_seqs=8),
    dict(max_num_batched_tokens=7, max_num_seqs=8),
    dict(max_num_batched_tokens=64, max_num_seqs=3),
    dict(max_num_batched_tokens=512, max_num_seqs=8, block_size=8),
], ids=["chunk64", "chunk7", "seqs3", "chunk512-bs8"])
def test_batched_greedy_equals_transformers(tiny_engine, case, levers):
    model_dir, prompts, refs, seed = case
    outs = _run(tiny_engine, model_dir, prompts, **levers)
    for i, (out, (ref_tokens, ref_lp, margins)) in enumerate(zip(outs, refs)):
        comp = out.outputs[0]
        assert_same_greedy(f"prompt {i} (len {len(prompts[i])}, seed {seed})", comp.token_ids, ref_tokens, margins)
        assert comp.finish_reason == "length"
        # logprobs of the chosen tokens equal transformers' log-softmax (until a tie diverges)
        for j, (tok, lp_ref) in enumerate(zip(comp.token_ids, ref_lp)):
            if tok != ref_tokens[j]:
                break
            assert_logprob_close(f"prompt {i} token {j} (seed {seed})", prompts[i] + ref_tokens[:j], tok,
                                 comp.logprobs[j][tok].logprob, lp_ref, model_dir)


def test_chunk1_and_alone(tiny_engine, case):
    """Token budget 1 (every prefill token its own step) on a subset, and each prompt run alone."""
    model_dir, prompts, refs, seed = case
    subset = [0, 3, 4]
    outs = _run(tiny_engine, model_dir, [prompts[i] for i in subset], max_num_batched_tokens=1, max_num_seqs=8)
    for i, out in zip(subset, outs):
        assert_same_greedy(f"chunk1 prompt {i} seed {seed}", out.outputs[0].token_ids, refs[i][0], refs[i][2])
    llm = tiny_engine(model=model_dir)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i in (1, 5, 7):
        alone = llm.generate({"prompt_token_ids": prompts[i]}, params)[0]
        assert_same_greedy(f"alone prompt {i} seed {seed}", alone.outputs[0].token_ids, refs[i][0], refs[i][2])
