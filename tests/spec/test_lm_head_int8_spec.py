"""The int8 lm_head on the fitted tiny model: top-1 agreement with the dense head and the max logit error on
its greedy steps (published in VALIDATION.md), greedy output unchanged by MTP speculation over it, and the MTP
drafter's fused top-1 (interpreter on the CPU) equal to the argmax of the int8 logits."""

from __future__ import annotations

import random

import torch

from qv import SamplingParams
from qv.kernels.linear import GPTQWeight
from qv.kernels.lm_head_top1 import build_top1_ranking
from qv.model.layers import Linear
from qv.model.lm_head_int8 import lm_head_int8
from qv.model.qwen3_5 import load_text_model
from qv.spec.fit import _greedy, _target_pass


def test_int8_head_agrees_on_the_fitted_models_greedy_steps(fitted_dir):
    model = load_text_model(fitted_dir)
    vocab = model.cfg.vocab_size
    dense = Linear(model.lm_head.weight.clone())
    quant = lm_head_int8(Linear(model.lm_head.weight.clone()))
    rng = random.Random(36)
    steps = agree = 0
    worst = spread = lp_worst = 0.0
    for i in range(24):
        prompt = [rng.randrange(vocab) for _ in range(4 + i % 9)]
        ids = _greedy(model, prompt, 40)
        hidden, _ = _target_pass(model, ids)
        h = hidden[len(prompt) - 1:-1]  # the states each greedy token was chosen from
        a, b = dense(h).float()[:, :vocab], quant(h).float()[:, :vocab]
        steps += h.shape[0]
        agree += int((a.argmax(1) == b.argmax(1)).sum())
        worst = max(worst, float((a - b).abs().max()))
        lp_a, lp_b = torch.log_softmax(a, 1), torch.log_softmax(b, 1)
        top = lp_a.topk(5, dim=1).indices
        lp_worst = max(lp_worst, float((lp_a.gather(1, top) - lp_b.gather(1, top)).abs().max()))
        spread = max(spread, float(a.std()))
    rate = agree / steps
    print(f"fitted tiny model, int8 lm_head: agreement {rate:.4f} on {steps} greedy steps, "
          f"max logit error {worst:.3e} (logit std {spread:.2f}), max top-5 logprob error {lp_worst:.3e}")
    assert rate >= 0.998
    assert worst < 0.05 * spread


def test_greedy_output_identical_with_mtp_over_the_int8_head(tiny_engine, fitted_dir):
    rng = random.Random(7)
    prompts = [{"prompt_token_ids": [rng.randrange(300) for _ in range(n)]} for n in (3, 11, 26)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    base = tiny_engine(model=fitted_dir, lm_head_int8=True)
    assert isinstance(base.engine.runner.model.lm_head.weight, GPTQWeight)
    want = [o.outputs[0] for o in base.generate(prompts, params)]
    spec = tiny_engine(model=fitted_dir, lm_head_int8=True, spec="mtp", spec_k=3)
    got = [o.outputs[0] for o in spec.generate(prompts, params)]
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.token_ids == b.token_ids, f"prompt {i}"
    assert spec.engine.spec.stats.num_accepted_tokens > 0


def test_mtp_fused_top1_over_the_int8_head(tiny_engine, fitted_dir):
    llm = tiny_engine(model=fitted_dir, lm_head_int8=True, spec="mtp", spec_k=2)
    head = llm.engine.spec.head
    head.ranking = build_top1_ranking(head.target.lm_head.weight, 4)  # built on GPUs only; the interpreter here
    out = torch.randn(3, head.cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    want = head.target.compute_logits(out)[:, :head.cfg.vocab_size].argmax(1)
    assert torch.equal(head.draft_ids(out), want)
