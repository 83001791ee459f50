"""Sampling with speculation follows the target distribution: the tokens emitted at temperature 1 with MTP
or n-gram drafts (verified by rejection sampling) have the histograms of sampling without speculation,
position by position (chi-square two-sample test over the most frequent tokens, fixed seeds), on the CPU's
reference kernels and on the GPU's. The speculative metrics count what was drafted and accepted."""

from __future__ import annotations

import numpy as np
import pytest

from qv import SamplingParams
from tests.spec.test_spec_engine import model_list
from util import chi2_bound

SAMPLES = 320
POSITIONS = (1, 2, 3)  # output positions verification decides (position 0 is sampled after the prefill)
BINS = 12  # the most frequent tokens, the rest pooled
# chi-square checks per run: POSITIONS x 2 modes x (CPU, GPU); each gets 1/12 of FALSE_ALARM_PER_RUN (1e-6).
# The seeds are fixed, so the test is deterministic: this is how unlikely a false alarm was when they were chosen.
CHI2_CHECKS = len(POSITIONS) * 2 * 2


def _tokens(tiny_engine, model_dir, device: str, **levers) -> np.ndarray:
    llm = tiny_engine(model=model_dir, device=device, dtype="float32", max_num_seqs=32, spec_max_seqs=32,
                      kv_cache_bytes=256 << 20,
              **levers)
    prompt = {"prompt_token_ids": model_list(6, 3) * 2}
    params = SamplingParams(n=SAMPLES, temperature=1.0, max_tokens=max(POSITIONS) + 1, ignore_eos=True, seed=1234)
    out = llm.generate([prompt], params)[0].outputs
    return np.array([o.token_ids[:max(POSITIONS) + 1] for o in out]), llm


def _chi_square(a: np.ndarray, b: np.ndarray) -> tuple[float, int]:
    """Two-sample chi-square statistic over the BINS most frequent tokens of both, the rest pooled."""
    ids, counts = np.unique(np.concatenate([a, b]), return_counts=True)
    top = ids[np.argsort(-counts)[:BINS]]
    ha = [np.sum(a == t) for t in top] + [np.sum(~np.isin(a, top))]
    hb = [np.sum(b == t) for t in top] + [np.sum(~np.isin(b, top))]
    ha, hb = np.array(ha, float), np.array(hb, float)
    keep = (ha + hb) > 0
    ha, hb = ha[keep], hb[keep]
    na, nb = ha.sum(), hb.sum()
    stat = np.sum((ha * np.sqrt(nb / na) - hb * np.sqrt(na / nb)) ** 2 / (ha + hb))
    return float(stat), int(keep.sum() - 1)


def _check(tiny_engine, model_dir, device: str, mode: str):
    base, _ = _tokens(tiny_engine, model_dir, device)
    spec, llm = _tokens(tiny_engine, model_dir, device, spec=mode, spec_k=3, spec_policy="always")
    for pos in POSITIONS:
        stat, dof = _chi_square(base[:, pos], spec[:, pos])
        assert stat < chi2_bound(dof,
                                 CHI2_CHECKS), f"{mode} on {device}: output position {pos}: chi2 {stat:.1f}, {dof} dof"
    s = llm.engine.spec.stats
    assert s.num_drafts > 0 and s.num_draft_tokens == 3 * s.num_drafts
    assert 0 < s.num_accepted_tokens <= s.num_draft_tokens
    assert s.accepted_per_pos[0] >= s.accepted_per_pos[1] >= s.accepted_per_pos[2]  # a run is accepted in order
    assert sum(s.accepted_per_pos) == s.num_accepted_tokens
    metrics = llm.engine.stats
    assert (metrics.spec_num_drafts, metrics.spec_num_accepted_tokens) == (s.num_drafts, s.num_accepted_tokens)


@pytest.mark.parametrize("mode", ["mtp", "ngram"])
def test_sampled_tokens_follow_the_target_distribution_cpu(tiny_engine, fitted_dir, mode):
    _check(tiny_engine, fitted_dir, "cpu", mode)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["mtp", "ngram"])
def test_sampled_tokens_follow_the_target_distribution_gpu(tiny_engine, fitted_dir, mode):
    _check(tiny_engine, fitted_dir, "cuda", mode)
