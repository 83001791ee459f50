"""n-gram drafts and the verification rule, on synthetic inputs (no model)."""

from __future__ import annotations

import random

import pytest
import torch

from qv.spec.ngram import propose_ngram
from qv.spec.verify import verify
from util import chi2_bound, normal_bound

# Statistical checks per run: two chi-square checks and one acceptance count for each k of
# test_rejection_sampling_preserves_target_distribution; each gets 1/6 of FALSE_ALARM_PER_RUN (1e-6).
STAT_CHECKS = 6


def test_ngram_longest_latest_exactly_k():
    assert propose_ngram([1, 2, 3, 4, 5, 6, 1, 2, 3], 3) == [4, 5, 6]
    # the longest suffix wins: [7, 1, 2] matches only at the second occurrence
    assert propose_ngram([1, 2, 9, 9, 7, 1, 2, 5, 5, 7, 1, 2], 2) == [5, 5]
    # the latest occurrence wins among equal lengths
    assert propose_ngram([1, 2, 8, 1, 2, 9, 1, 2], 1) == [9]
    # exactly k tokens or nothing
    assert propose_ngram([1, 2, 3, 1, 2], 4) is None
    assert propose_ngram([5, 6, 7], 2) is None
    rng = random.Random(0)
    seq = [rng.randrange(50) for _ in range(rng.randrange(10, 200))]
    for k in (1, 3, 5):
        d = propose_ngram(seq, k)
        assert d is None or len(d) == k


def _ngram_by_brute_force(tokens: list[int], k: int, min_n: int = 2, max_n: int = 8) -> list[int] | None:
    """The rule spelled out: longest suffix first, latest occurrence first, k followers inside the sequence."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        for i in range(length - n - k, -1, -1):
            if tokens[i:i + n] == suffix:
                return tokens[i + n:i + n + k]
    return None


@pytest.mark.parametrize("vocab", [2, 3, 8, 40])
def test_ngram_equals_the_brute_force_rule(vocab):
    rng = random.Random(0)
    for _ in range(200):
        seq = [rng.randrange(vocab) for _ in range(rng.randrange(1, 120))]
        k = rng.randrange(1, 6)
        assert propose_ngram(seq, k) == _ngram_by_brute_force(seq, k), (seq, k)
    long = [rng.randrange(vocab) for _ in range(20000)]  # past the window: only its last WINDOW tokens count
    assert propose_ngram(long, 3) == _ngram_by_brute_force(long[-8192:], 3)


def _verify_greedy(greedy, drafts):
    g = torch.tensor(greedy)
    d = torch.tensor(drafts)
    s = g.shape[0]
    return verify(g, None, d, torch.ones(s, dtype=torch.bool), torch.zeros(s, dtype=torch.int64),
                  torch.zeros(s, dtype=torch.int64))


def test_greedy_accepts_while_equal_then_target_token():
    res = _verify_greedy([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8]], [[5, 6, 7], [5, 9, 7], [1, 6, 7]])
    assert res.num_accepted.tolist() == [3, 1, 0]
    assert res.tokens[0].tolist() == [5, 6, 7, 8]
    assert res.tokens[1, :2].tolist() == [5, 6]
    assert res.tokens[2, :1].tolist() == [5]


def test_out_of_vocabulary_drafts_rejected_not_scattered():
    probs = torch.softmax(torch.randn(2, 3, 10), -1)
    greedy = probs.argmax(-1)
    drafts = torch.tensor([[10**6, 1], [-5, 2]])
    res = verify(greedy, probs, drafts, torch.tensor([False, True]), torch.tensor([1, 2]), torch.tensor([0, 0]))
    assert res.num_accepted.tolist() == [0, 0]
    assert ((res.tokens >= 0) & (res.tokens < 10)).all()


@pytest.mark.parametrize("k", [1, 3])
def test_rejection_sampling_preserves_target_distribution(k):
    """Emitted tokens follow the target: t1 ~ p0 always; given t1 == d1, t2 ~ p1. >= 20,000 samples."""
    vocab, n = 6, 24000
    logits = torch.randn(k + 1, vocab) * 1.5
    p = torch.softmax(logits, -1)
    drafts = torch.randint(0, vocab, (k,))
    seed0 = random.randrange(1 << 40)
    res = verify(p.argmax(-1).expand(n, k + 1), p.expand(n, k + 1, vocab).contiguous(), drafts.expand(n, k),
                 torch.zeros(n, dtype=torch.bool), torch.arange(n) + seed0, torch.zeros(n, dtype=torch.int64))
    first = res.tokens[:, 0]
    _chi2(torch.bincount(first, minlength=vocab).double(), p[0].double() * n, "t1")
    second = res.tokens[:, 1][(first == drafts[0]) & (res.num_accepted >= 1)]
    m = second.numel()
    # acceptance rate of d1 is p0(d1) (n / 4 bounds the binomial's variance)
    assert abs(m - p[0, drafts[0]].item() * n) < normal_bound(STAT_CHECKS) * (n * 0.25) ** 0.5
    if m > 500:
        _chi2(torch.bincount(second, minlength=vocab).double(), p[1].double() * m, "t2 | t1 = d1")


def _chi2(counts, expect, name):
    live = expect > 5
    chi2 = float((((counts - expect) ** 2) / expect)[live].sum())
    df = int(live.sum()) - 1
    bound = chi2_bound(df, STAT_CHECKS)
    assert chi2 < bound, f"{name}: chi2 {chi2:.1f} >= {bound:.1f} (df {df}); counts {counts.tolist()}, {expect.tolist()}"


def test_token_array_follows_the_sequence():
    """The n-gram lookup's NumPy view of a sequence stays equal to its token lists as tokens are appended,
    a placeholder is replaced in place and the buffer grows."""
    from qv.engine.sequence import PENDING, Sequence

    rng = random.Random(0)
    seq = Sequence(0, "r", 0, [rng.randrange(1000) for _ in range(rng.randrange(1, 300))], None, 10, 0, None, 0)
    for _ in range(700):
        if rng.random() < 0.2:
            seq.output_token_ids.append(PENDING)
            seq.token_array(0)
            seq.output_token_ids[-1] = rng.randrange(1000)  # the real token replaces the placeholder
        else:
            seq.output_token_ids.append(rng.randrange(1000))
        start = rng.randrange(seq.num_tokens)
        assert seq.token_array(start).tolist() == seq.all_token_ids()[start:]
