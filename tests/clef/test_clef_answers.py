"""qv's Clef answers against Cloudflare's `systemone()` on the merged fp32 weights, for both weight
layouts: (a) a release folder (no deltas) and (b) base weights + clef/ (PEFT LoRA on every kind of
decoder linear incl. GDN projections, rank-1 deabl), where qv applies the deltas per row and the
oracle runs weights merged by PEFT / clef-finetune's `export.merge`.

Same response keys in the same order, same choice, legend and usage; every probability (and
score, confidence) within BOUND of the oracle's. The raw (unrounded) max |dp| is printed.
"""

from __future__ import annotations

import math

import pytest
import torch

from clef_records import answer_cases
from clef_systemone import systemone_with_probabilities
from qv.clef.offline import decide

BOUND = 1e-4  # on probabilities, CPU fp32 both sides
NMAX = 34816


def _numbers(answer: dict) -> list[tuple[str, float]]:
    out = [(k, answer[k]) for k in ("noul", "score", "confidence") if k in answer]
    out += [(f"p[{k}]", v) for k, v in answer.get("probabilities", {}).items()]
    return out


def compare(ours: dict, ref: dict, raw_ours: list[list[float]], raw_ref: list[list[float]]) -> float:
    """Assert the two responses agree; return the raw max |dp|."""
    assert list(ours) == list(ref) and ours["model"] == ref["model"] and ours["usage"] == ref["usage"]
    assert list(ours["answers"]) == list(ref["answers"]), "question order"
    dp = max(abs(a - b) for qa, qb in zip(raw_ours, raw_ref, strict=True) for a, b in zip(qa, qb, strict=True))
    for qid, a in ours["answers"].items():
        b = ref["answers"][qid]
        assert list(a) == list(b), f"{qid}: keys {list(a)} vs {list(b)}"
        assert a["type"] == b["type"] and a.get("legend") == b.get("legend")
        if "probabilities" in a:
            assert list(a["probabilities"]) == list(b["probabilities"]), f"{qid}: option order"
        if a.get("choice") != b.get("choice"):  # only a true near-tie may flip the argmax
            top = sorted(b["probabilities"].values())[-2:]
            assert top[1] - top[0] <= 2 * BOUND, f"{qid}: choice {a['choice']} vs {b['choice']}"
        for (name, x), (_, y) in zip(_numbers(a), _numbers(b), strict=True):
            # rounding to 4 decimals can turn a tiny difference into one unit of the last place
            slack = BOUND + 1e-9 + (len(a.get("legend", {})) * dp if name == "score" else 0.0)
            assert abs(x - y) <= slack, f"{qid} {name}: qv {x} vs Clef {y}"
    return dp


@pytest.mark.parametrize("layout", ["release", "adapters"])
def test_answers_match_clef_systemone(jsm, references, qv_clef, tokenizers, layout):
    # 64 questions (8.5K tokens here: the tiny tokenizer is nearly byte-level) where the deltas are;
    # 32 in the release layout, to keep the CPU oracle runs of the whole set within minutes
    records = answer_cases(*{"release": (1, 32), "adapters": (2, 64)}[layout])
    assert len(records) >= 30
    ref_model, processor = references[layout]
    model, assets = qv_clef[layout]
    assert (assets.layout, assets.lora_modules > 0, assets.deabl_modules > 0) == \
        (layout, layout == "adapters", layout == "adapters")
    worst, spread = 0.0, []
    for i, record in enumerate(records):
        ref, raw_ref = systemone_with_probabilities(jsm, ref_model, processor, record)
        ours, raw_ours = decide_raw(model, assets.head, tokenizers[layout], record)
        try:
            worst = max(worst, compare(ours, ref, raw_ours, raw_ref))
        except AssertionError as e:
            raise AssertionError(f"record {i} ({layout}): {e}") from None
        spread += [p for q in raw_ref for p in q]
    print(f"\nClef {layout}: {len(records)} records, max |dp| {worst:.2e}")
    assert worst <= BOUND
    # the fixture's head must give decisive answers, or |dp| would say little
    assert max(spread) > 0.9 and min(spread) < 0.05, (min(spread), max(spread))


def decide_raw(model, head, tokenizer, record):
    from qv.clef.answers import response
    from qv.clef.offline import run_record
    from qv.clef.request import encode_request

    encoded = encode_request(tokenizer, record, NMAX)
    # long records in 1024-token chunks: the CPU reference attention costs half as much causally,
    # and the chunked head accumulation is exercised against the oracle too
    chunk = 1024 if encoded.num_tokens > 2048 else None
    probs = run_record(model, head, encoded, chunk).probabilities()
    return response(record["model"], encoded, probs), probs


def test_decide_is_the_same_pipeline(qv_clef, tokenizers):
    """`decide` (the offline API) returns what the pieces above return."""
    record = answer_cases(1)[0]
    model, assets = qv_clef["release"]
    assert decide(model, assets.head, tokenizers["release"], record, NMAX) == \
        decide_raw(model, assets.head, tokenizers["release"], record)[0]


def test_deltas_change_clef_rows_only(qv_clef, tokenizers):
    """Layout (b)'s deltas matter (the answers move without them) and touch no base weight."""
    from qv.clef.offline import run_record
    from qv.clef.request import encode_request

    model, assets = qv_clef["adapters"]
    record = encode_request(tokenizers["adapters"], answer_cases(2)[3], NMAX)
    with_deltas = run_record(model, assets.head, record).probabilities()
    without = run_record(model, assets.head, record, deltas=False).probabilities()
    diff = max(abs(a - b) for qa, qb in zip(with_deltas, without) for a, b in zip(qa, qb))
    assert diff > 1e-3, diff
    assert assets.delta_bytes > 0 and math.isfinite(diff)
    assert all(torch.isfinite(torch.tensor(q)).all() for q in with_deltas)
