"""Hugging Face transformers as the engine's oracle: a plain no-cache greedy argmax loop."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=4)
def hf_model(model_dir: str):
    import transformers

    transformers.logging.set_verbosity_error()
    from qv.config import ModelConfig

    cls = (transformers.Qwen3_5ForCausalLM if ModelConfig.from_dir(model_dir).architecture == "Qwen3_5ForCausalLM"
           else transformers.Qwen3_5ForConditionalGeneration)
    return cls.from_pretrained(model_dir, dtype=torch.float64).eval()


@torch.no_grad()
def hf_greedy(model_dir: str, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float], list[float]]:
    """(tokens, log-softmax of each chosen token, top-1 minus top-2 logit margin at each step), float64."""
    model = hf_model(model_dir)
    ids = list(prompt)
    out, logprobs, margins = [], [], []
    for _ in range(max_tokens):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1].double()
        top2 = logits.topk(2)
        tok = int(top2.indices[0])
        out.append(tok)
        logprobs.append(float(torch.log_softmax(logits, -1)[tok]))
        margins.append(float(top2.values[0] - top2.values[1]))
        ids.append(tok)
    return out, logprobs, margins


def assert_same_greedy(name: str, ours: list[int], ref: list[int], margins: list[float], tie: float = 1e-4) -> None:
    """Token-identical, except that a divergence exactly where the oracle's top two logits are within
    `tie` of each other is a numerical tie (fp32 vs fp64), after which the runs are incomparable."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            assert margins[i] < tie, f"{name}: token {i}: ours {a} != transformers {b} (margin {margins[i]:.2e})"
            return
    assert len(ours) == len(ref), f"{name}: {len(ours)} tokens, transformers {len(ref)}"


LOGPROB_BOUND = 1e-4  # |qv fp32 logprob - transformers float64 logprob| (issue 3)
NOISE_FACTOR, CEILING = 4.0, 1e-3  # as tests/hf_oracle.py: fp32's own rounding on ill-conditioned tokens


@functools.lru_cache(maxsize=4)
def hf_model_fp32(model_dir: str):
    import copy

    return copy.deepcopy(hf_model(model_dir)).float().eval()


@torch.no_grad()
def assert_logprob_close(name: str, context: list[int], tok: int, ours: float, ref: float, model_dir: str) -> None:
    """qv's logprob of `tok` after `context` within LOGPROB_BOUND of transformers' float64 one; where
    fp32 itself cannot hold that bound for this very token (transformers' own fp32 run misses it
    too), within NOISE_FACTOR of transformers' fp32 error, never above CEILING."""
    err = abs(ours - ref)
    if err < LOGPROB_BOUND:
        return
    logits = hf_model_fp32(model_dir)(input_ids=torch.tensor([context])).logits[0, -1].double()
    noise = abs(float(torch.log_softmax(logits, -1)[tok]) - ref)
    assert err <= min(CEILING, NOISE_FACTOR * noise), \
        f"{name}: logprob {ours:.7f} vs transformers {ref:.7f} (error {err:.1e}; transformers' own fp32 error {noise:.1e})"
