"""Sampler: distributions (chi-square), seeded reproducibility across batch compositions, and the
per-request controls (penalties, min_tokens, stops, logprobs, n)."""

from __future__ import annotations

import random

import pytest
import torch

from qv import SamplingParams
from qv.engine.sampler import SamplingBatch, filter_probs, sample
from util import chi2_bound

# The chi-square checks in this file per run (the parameters of test_sampler_distribution_chi_square):
# each gets 1/6 of FALSE_ALARM_PER_RUN, so a correct sampler fails a CI run here with probability <= 1e-6.
CHI2_CHECKS = 6


def _batch(rows: int, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed0=None) -> SamplingBatch:
    seed0 = random.randrange(1 << 40) if seed0 is None else seed0
    full = lambda v, dt: torch.full((rows,), v, dtype=dt)  # noqa: E731
    return SamplingBatch(full(temperature, torch.float32), full(top_p, torch.float32), full(top_k, torch.int64),
                         full(min_p, torch.float32), torch.arange(rows, dtype=torch.int64) + seed0,
                         torch.zeros(rows, dtype=torch.int64), any_filter=top_k > 0 or top_p < 1 or min_p > 0)


def _expected(logits: torch.Tensor, temperature, top_p, top_k, min_p) -> torch.Tensor:
    """Independent statement of the target distribution (sorted-vocab definition)."""
    p = torch.softmax(logits.double() / temperature, -1)
    order = p.argsort(descending=True)
    keep = torch.zeros_like(p, dtype=torch.bool)
    mass = 0.0
    for rank, t in enumerate(order.tolist()):
        if top_k and rank >= top_k:
            break
        if rank > 0 and mass >= top_p:
            break
        keep[t] = True
        mass += float(p[t])
    if top_k:  # top-p mass is measured on the renormalised top-k distribution
        pk = torch.where(torch.zeros_like(keep).index_fill_(0, order[:top_k], True), p, 0.0)
        pk = pk / pk.sum()
        keep[:] = False
        mass = 0.0
        for rank, t in enumerate(order[:top_k].tolist()):
            if rank > 0 and mass >= top_p:
                break
            keep[t] = True
            mass += float(pk[t])
        p = pk
    p = torch.where(keep, p, 0.0)
    p = torch.where(p >= min_p * p.max(), p, 0.0)
    return p / p.sum()


@pytest.mark.parametrize("temperature,top_p,top_k,min_p", [
    (1.0, 1.0, 0, 0.0), (0.7, 1.0, 0, 0.0), (1.3, 0.8, 0, 0.0), (1.0, 1.0, 3, 0.0), (1.0, 0.9, 4, 0.0),
    (1.0, 1.0, 0, 0.2),
])
def test_sampler_distribution_chi_square(temperature, top_p, top_k, min_p):
    vocab, n = 8, 40000
    logits = torch.tensor([2.0, 1.5, 1.0, 0.7, 0.2, -0.3, -1.0, -2.0])[torch.randperm(vocab)]
    b = _batch(n, temperature, top_p, top_k, min_p)
    ids = sample(logits.expand(n, vocab).clone(), b).token_ids
    counts = torch.bincount(ids, minlength=vocab).double()
    expect = _expected(logits, temperature, top_p, top_k, min_p) * n
    assert (counts[expect == 0] == 0).all(), f"sampled a token the filters remove: {counts} vs {expect}"
    live = expect > 0
    chi2 = float((((counts - expect) ** 2) / expect.clamp_min(1e-9))[live].sum())
    df = int(live.sum()) - 1
    if df > 0:
        bound = chi2_bound(df, CHI2_CHECKS)
        assert chi2 < bound, f"chi2 {chi2:.1f} >= {bound:.1f} (df {df}); counts {counts.tolist()}"
    # filter_probs itself agrees with the independent statement
    assert torch.allclose(filter_probs(logits[None], _batch(1, temperature, top_p, top_k, min_p))[0].double(),
                          expect / n, atol=1e-6)


def test_rows_without_filters_skip_the_sort_and_get_the_same_probabilities():
    logits = torch.randn(5, 1000) * 3
    plain, sorted_path = _batch(5, 0.8), _batch(5, 0.8)
    sorted_path.any_filter = True
    assert not plain.any_filter
    torch.testing.assert_close(filter_probs(logits, plain), filter_probs(logits, sorted_path), atol=1e-7, rtol=1e-5)


def test_noise_depends_only_on_seed_position_token():
    b1 = _batch(4, seed0=99)
    b2 = _batch(4, seed0=99)
    logits = torch.randn(4, 50)
    assert torch.equal(sample(logits, b1).token_ids, sample(logits, b2).token_ids)
    b3 = _batch(4, seed0=100)
    draws = {tuple(sample(logits, _batch(4, seed0=s)).token_ids.tolist()) for s in range(20)}
    assert len(draws) > 1 and b3 is not None


def test_seeded_requests_reproducible_across_batches(tiny_engine):
    llm = tiny_engine()
    target = {"prompt_token_ids": [3, 14, 15, 92, 65]}
    p = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=1234, max_tokens=20, ignore_eos=True)
    alone = llm.generate(target, p)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": [random.randrange(300) for _ in range(random.randrange(1, 60))]} for _ in range(5)]
    mixed = llm.generate(others[:2] + [target] + others[2:], [SamplingParams(temperature=1.0, max_tokens=25)] * 2 + [p]
                         + [SamplingParams(temperature=0.5, max_tokens=7)] * 3)
    assert mixed[2].outputs[0].token_ids == alone
    unseeded = {tuple(llm.generate(target, SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True))[0]
                      .outputs[0].token_ids) for _ in range(3)}
    assert len(unseeded) > 1, "unseeded sampling repeated itself"


def test_controls(tiny_engine):
    llm = tiny_engine()
    prompt = {"prompt_token_ids": [10, 20, 30, 40]}
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    # stop token id inside the greedy run: stops there, reason is the id, token included
    stop_tok = greedy.token_ids[5]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_tok]))[0].outputs[0]
    first = greedy.token_ids.index(stop_tok)
    assert out.token_ids == greedy.token_ids[:first + 1] and out.stop_reason == stop_tok and out.finish_reason == "stop"
    # min_tokens masks stop tokens until reached
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, min_tokens=first + 3,
                                              stop_token_ids=[stop_tok]))[0].outputs[0]
    assert stop_tok not in out.token_ids[:first + 3]
    # repetition penalty changes the greedy run; logprobs report top-N with ranks
    pen = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                              repetition_penalty=5.0, presence_penalty=2.0))[0].outputs[0]
    assert pen.token_ids != greedy.token_ids
    lp = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3, logprobs=3))[0].outputs[0]
    for tok, entry in zip(lp.token_ids, lp.logprobs):
        assert entry[tok].rank == 1 and len(entry) == 3
        assert sorted(e.rank for e in entry.values()) == [1, 2, 3]
    # n samples, each a full completion
    many = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, max_tokens=5, ignore_eos=True, seed=7))[0]
    assert [o.index for o in many.outputs] == [0, 1, 2] and all(len(o.token_ids) == 5 for o in many.outputs)


def test_stop_string_inside_text(tiny_engine):
    llm = tiny_engine()
    prompt = {"prompt_token_ids": [7, 8, 9]}
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].outputs[0]
    text = full.text
    stop = next((text[i:i + 2] for i in range(3, len(text) - 2) if "\ufffd" not in text[i:i + 2]), None)
    assert stop, f"greedy text too short to pick a stop string: {text!r}"
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:text.index(stop)] and stop not in out.text
    inc = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, stop=stop,
                                              include_stop_str_in_output=True))[0].outputs[0]
    assert inc.text == text[:text.index(stop) + len(stop)]


def test_one_upload_per_step(tiny_engine, monkeypatch):
    """Each step sends its batch and its sampling settings to the device in one upload, also with
    chunked prefill, penalties and logprobs in the batch; the settings read back equal the requests'."""
    from qv.engine.step_inputs import StepInputs

    llm = tiny_engine(max_num_batched_tokens=32, long_prefill_token_threshold=32)  # both rows meet
    sends, seen = [], []
    real_send = StepInputs.send
    monkeypatch.setattr(StepInputs, "send", lambda self, shape: (
        sends.append(sum(b - a for a, b in self._spans(shape))), real_send(self, shape)))
    import qv.engine.runner as runner_module

    real_sample = runner_module.sample

    def spy(logits, sb):  # settings as the device sees them, once the step's copy has run
        seen.append((sb.temperature.tolist(), sb.top_k.tolist(), sb.presence.tolist() if sb.presence is not None else None))
        return real_sample(logits, sb)

    monkeypatch.setattr(runner_module, "sample", spy)
    params = [SamplingParams(temperature=0.0, max_tokens=5),
              SamplingParams(temperature=0.7, top_k=5, seed=3, max_tokens=5, presence_penalty=0.5, logprobs=2)]
    llm.generate(["a " * 50, "b"], params)
    assert len(sends) == llm.engine._steps and min(sends) > 0
    requested = {(0.0, 0, 0.0), (0.7, 5, 0.5)}  # (temperature, top_k, presence) of the two requests
    for temps, top_ks, presence in seen:
        rows = zip((round(t, 6) for t in temps), top_ks, presence or [0.0] * len(temps))
        assert set(rows) <= requested, seen
    assert any(len(t) == 2 for t, _, _ in seen)


def test_the_engine_filters_rows_that_ask_for_it_beside_rows_that_do_not(tiny_engine):
    """top_k=1 (or a tiny top_p) at temperature 1 is greedy, also in a batch with unfiltered random rows."""
    llm = tiny_engine()
    prompt = [{"prompt_token_ids": [5, 6, 7, 8, 9]}]
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0].token_ids
    outs = llm.generate(prompt * 3, [SamplingParams(temperature=1.0, top_k=1, max_tokens=8, ignore_eos=True, seed=1),
                                     SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=2),
                                     SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=8, ignore_eos=True, seed=3)])
    assert outs[0].outputs[0].token_ids == greedy and outs[2].outputs[0].token_ids == greedy
