"""Chunked accumulation: a record of >= 4096 tokens run in 512-token chunks gives the answers of one
chunk; the head state does not depend on how the rows arrive, restarts cleanly, refuses rows out of
order; its measured peak memory follows the documented formula and stays far below the record's
hidden states."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from clef_records import make_record
from qv.clef.answers import answers
from qv.clef.head import KEY_BLOCK, LEXICAL_BLOCK, SCORE_ELEMENTS
from qv.clef.offline import run_record
from qv.clef.request import encode_request

NMAX = 34816
CHUNK_BOUND = 1e-5  # fp32: chunked attention/GDN/span sums only reorder float sums


def _long_record(tokenizer, min_tokens: int = 4096):
    record = make_record(77, n_questions=4, small=True)
    record["state"] = " ".join(["the checkout returns errors after the payment step and orders stay blocked"] * 58)
    encoded = encode_request(tokenizer, record, NMAX)
    assert encoded.num_tokens >= min_tokens, encoded.num_tokens
    return encoded


def test_chunks_of_512_equal_one_chunk(qv_clef, tokenizers):
    model, assets = qv_clef["release"]  # the cheaper preset: chunking is about the model's carried
    record = _long_record(tokenizers["release"])  # state and the head's accumulation, not the deltas
    whole = run_record(model, assets.head, record).probabilities()
    chunked = run_record(model, assets.head, record, chunk_size=512).probabilities()
    dp = max(abs(a - b) for qa, qb in zip(whole, chunked) for a, b in zip(qa, qb))
    print(f"\nClef chunked (512) vs one chunk, {record.num_tokens} tokens: max |dp| {dp:.2e}")
    assert dp <= CHUNK_BOUND
    a, b = answers(record, whole), answers(record, chunked)
    assert list(a) == list(b) and all(list(a[q]) == list(b[q]) for q in a)


def _random_state(head, record, chunks: list[int], hidden: torch.Tensor):
    state = head.state(record, torch.randn(512, head.config.hidden_size, generator=torch.Generator().manual_seed(1)))
    start = 0
    for n in chunks:
        state.add_chunk(hidden[start:start + n], start)
        start += n
    return state


def test_head_state_independent_of_chunking(qv_clef, tokenizers):
    _, assets = qv_clef["release"]
    head = assets.head
    record = encode_request(tokenizers["release"], make_record(5, n_questions=3, small=True), NMAX)
    t = record.num_tokens
    hidden = torch.randn(t, head.config.hidden_size, generator=torch.Generator().manual_seed(2))
    ref = _random_state(head, record, [t], hidden)
    for chunks in ([1] * 40 + [t - 40], [7] * (t // 7) + [t % 7], [512, t - 512] if t > 512 else [t // 2, t - t // 2]):
        chunks = [c for c in chunks if c]
        state = _random_state(head, record, chunks, hidden)
        assert torch.allclose(state.logits(), ref.logits(), atol=1e-5, rtol=0), chunks[:3]
        assert state.nbytes() == ref.nbytes()


def test_restart_and_order(qv_clef, tokenizers):
    _, assets = qv_clef["release"]
    head = assets.head
    record = encode_request(tokenizers["release"], make_record(6, small=True), NMAX)
    t = record.num_tokens
    hidden = torch.randn(t, head.config.hidden_size, generator=torch.Generator().manual_seed(3))
    ref = _random_state(head, record, [t], hidden).logits()
    state = _random_state(head, record, [t // 2], hidden)
    with pytest.raises(ValueError, match="chunks must come once each, in order"):
        state.add_chunk(hidden[: t // 2], 0)  # the same rows again (would double-count span sums)
    with pytest.raises(ValueError, match="the record is incomplete"):
        state.logits()
    state.reset()  # a preempted record restarts from token 0
    state.add_chunk(hidden, 0)
    assert torch.equal(state.logits(), ref)


def test_state_bytes_follow_the_formula(qv_clef, tokenizers):
    """T*W*4 + (S + O + 1)*H*4, the formula in head.py and docs/VALIDATION.md."""
    _, assets = qv_clef["release"]
    c = assets.head.config
    record = _long_record(tokenizers["release"])
    state = assets.head.state(record, torch.zeros(512, c.hidden_size))
    s = len(record.questions) + record.num_options
    assert state.nbytes() == record.num_tokens * c.width * 4 + (s + record.num_options + 1) * c.hidden_size * 4


def test_peak_memory_measured():
    """Measured in a fresh process: 32,768 tokens, H=2048, W=256, 64 questions x 7 options."""
    t, h, w, chunk = 32768, 2048, 256, 512
    probe = Path(__file__).with_name("clef_memprobe.py")
    # glibc would keep freed blocks of up to 32 MiB mapped after the first large free (its dynamic
    # mmap threshold); a fixed threshold returns them at once, so RSS tracks live memory
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, str(probe), str(t), str(h), str(w), str(chunk)], capture_output=True,
                         text=True, timeout=300, check=True, env=env)
    m = json.loads(out.stdout.strip().splitlines()[-1])
    formula = t * w * 4 + (64 + 2 * 448 + 1) * h * 4
    assert m["state_bytes"] == formula
    transient = 3 * chunk * h * 4 + 64 * chunk * 4 + 3 * KEY_BLOCK * w * 4 + SCORE_ELEMENTS * 4 + LEXICAL_BLOCK * h * 4
    mib = 1 << 20
    print(f"\nClef head state, {t} tokens H={h} W={w}: state {m['state_bytes'] / mib:.1f} MiB, measured peak "
          f"extra {m['peak_extra'] / mib:.1f} MiB, full fp32 hidden states {m['hidden_bytes'] / mib:.1f} MiB")
    assert m["peak_extra"] <= formula + transient + 8 * mib, m
    assert m["peak_extra"] < m["hidden_bytes"] / 2, m
