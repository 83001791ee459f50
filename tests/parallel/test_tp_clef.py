"""Clef records under tensor parallelism, on the CPU: layout (b) (LoRA + deabl deltas on every decoder
linear of layers 1..) on the "mixed" tiny geometry, one engine at tensor_parallel_size 2 (one gloo
worker) against one at 1. A record alone, then three records batched with three chats in the same
steps: every record's answers are TP 1's and its per-option probabilities within PROB_BOUND, every
chat's greedy tokens are TP 1's and their logprobs within LOGPROB_BOUND. TP 1 is Cloudflare's
systemone within tests/clef's bounds, so this chains TP 2 to that oracle.

It can fail: the deltas move the probabilities by far more than the bound (checked against the same
records without deltas), so a delta cut wrongly on a rank, added twice through the all-reduce, or not
applied on the worker (delta_rows not sent) shows; a delta on a chat row changes its tokens or logprobs;
the records' option tokens reach past rank 0's vocabulary slice, so lexical vectors read from rank 0's
lm_head shard would be wrong. delta_shard itself is checked against the whole delta, rank by rank.
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("clef_finetune")
pytest.importorskip("peft")

from clef.clef_records import max_dp, run_engine  # noqa: E402  (tests/ on sys.path)
from qv.clef.adapters import load_clef  # noqa: E402
from qv.clef.encode import option_token_ids  # noqa: E402
from qv.clef.offline import run_record  # noqa: E402
from qv.clef.request import encode_request  # noqa: E402
from qv.config import EngineConfig  # noqa: E402
from qv.engine import tensor_parallel  # noqa: E402
from qv.engine.engine import LLMEngine  # noqa: E402
from qv.engine.request import SamplingParams  # noqa: E402
from qv.model.parallel import TPGroup, column_shard, delta_shard, row_shard, vocab_range  # noqa: E402
from qv.model.qwen3_5 import load_text_model  # noqa: E402

NMAX = 34816
PROB_BOUND = 2e-5  # max |dp| TP 2 vs TP 1 (see docs/VALIDATION.md for the measured spread)
DELTA_EFFECT = 1e-2  # the records are drawn among those the deltas move by at least this (500x the bound)
LOGPROB_BOUND = 1e-4  # chats' chosen-token logprobs, absolute, as tests/parallel/test_tp_engine.py
LEVERS = dict(device="cpu", prefix_caching=False, media_max_images=0, media_max_videos=0, max_model_len=2048,
              max_num_batched_tokens=1024, long_prefill_token_threshold=1024, max_long_partial_prefills=4)
CHAT = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """(folder, records, chats, seed, probabilities without deltas per record); records drawn at
    random among those the deltas move by DELTA_EFFECT (a record of one-option questions moves by 0)."""
    from transformers import AutoTokenizer

    from clef.clef_records import make_record
    from clef.fixtures import make_clef_adapters  # tests/ on sys.path; needs clef-finetune and peft

    folder = make_clef_adapters(tmp_path_factory.mktemp("tpclef") / "adapters", "mixed", seed=5)
    tok = AutoTokenizer.from_pretrained(folder)
    model = load_text_model(str(folder))
    head = load_clef(folder, model).head
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    records, bare = {}, {}
    for _ in range(40):
        rec = encode_request(tok, make_record(rng.randrange(1 << 20), n_questions=2, small=True), NMAX)
        without = run_record(model, head, rec, deltas=False).probabilities()
        if max_dp(run_record(model, head, rec).probabilities(), without) >= DELTA_EFFECT:
            rid = f"r{len(records)}"
            records[rid], bare[rid] = rec, without
        if len(records) == 3:
            break
    assert len(records) == 3, f"seed {seed}: the deltas moved fewer than 3 of 40 records by {DELTA_EFFECT}"
    chats = {f"c{j}": [rng.randrange(3, 250) for _ in range(rng.randint(5, 40))] for j in range(3)}
    return folder, records, chats, seed, bare


def serve(folder, records: dict, chats: dict, world: int) -> tuple[dict, dict]:
    """(record r0 alone, everything batched) through one engine of `world` ranks."""
    eng = LLMEngine(EngineConfig(model=str(folder), tensor_parallel_size=world, **LEVERS))
    try:
        return run_engine(eng, {"r0": records["r0"]}, {}, CHAT), run_engine(eng, records, chats, CHAT)
    finally:
        eng.shutdown()


@pytest.mark.timeout(300)  # a collective the ranks do not share would wait out the process group timeout
def test_clef_records_tp2_equal_tp1(case, monkeypatch):
    folder, records, chats, seed, bare = case
    print(f"seed {seed}")
    vocab = load_text_model(str(folder)).cfg.vocab_size
    first_slice_end = vocab_range(vocab, TPGroup(0, 2))[1]
    assert any(t >= first_slice_end for r in records.values() for o in option_token_ids(r) for t in o), \
        "no option token past rank 0's vocabulary slice: the lexical vectors are not exercised"

    sent = []  # (rows in the step, delta rows) of every step the driver sent
    send_step = tensor_parallel.TPDriver.send_step

    def spied(self, inputs, st, *rest):
        sent.append((st.shape.rows, st.shape.delta_rows or None))
        return send_step(self, inputs, st, *rest)

    ref_alone, ref = serve(folder, records, chats, 1)
    monkeypatch.setattr(tensor_parallel.TPDriver, "send_step", spied)
    got_alone, got = serve(folder, records, chats, 2)

    worst, moved = 0.0, []
    for rid, g, r in [("r0 alone", got_alone["r0"], ref_alone["r0"])] + [(k, got[k], ref[k]) for k in records]:
        assert g.clef is not None and r.clef is not None, (rid, g.error, r.error)
        assert list(g.clef.answers) == list(r.clef.answers), rid
        assert all(g.clef.answers[q].get("choice") == r.clef.answers[q].get("choice") for q in g.clef.answers), rid
        worst = max(worst, max_dp(g.clef.probabilities, r.clef.probabilities))
        moved.append(max_dp(g.clef.probabilities, bare[rid.split()[0]]))
    print(f"seed {seed}: Clef max |dp| TP 2 vs TP 1 {worst:.1e}; the deltas move it by {min(moved):.1e}..{max(moved):.1e}")
    assert worst <= PROB_BOUND
    assert any(d is not None and d < n for n, d in sent), "no step sent both Clef and chat rows to the worker"
    assert min(moved) >= DELTA_EFFECT / 2, "TP 2 is close to the records without deltas: were they applied?"

    for rid in chats:
        g, r = got[rid].outputs[0], ref[rid].outputs[0]
        assert g.token_ids == r.token_ids, rid
        for tok, ge, re in zip(g.token_ids, g.logprobs, r.logprobs):
            assert abs(ge[tok].logprob - re[tok].logprob) < LOGPROB_BOUND, rid


@pytest.mark.parametrize("split, pieces", [("column", [12, 12, 20]), ("column", None), ("row", None)])
def test_delta_shard_cuts_like_the_weight(split, pieces):
    """Each rank's cut of a delta computes what the same cut of the merged delta weight B A computes:
    its output columns (column_shard, each piece split alike) or its partial sum over its input rows
    (row_shard; the partials sum to the whole delta)."""
    gen = torch.Generator().manual_seed(0)
    world, r, k, n = 2, 3, 16, sum(pieces or [40])
    a, b, x = (torch.randn(s, generator=gen, dtype=torch.float64) for s in ((r, k), (n, r), (5, k)))
    merged, partials = b @ a, []
    for rank in range(world):
        tp = TPGroup(rank, world)
        ca, cb = delta_shard(a, b, split, pieces, tp, "test")
        if split == "column":
            assert torch.allclose(x @ ca.t() @ cb.t(), x @ column_shard(merged, pieces or [n], tp, "test").t())
        else:
            xs = x[:, rank * k // world:(rank + 1) * k // world]
            partials.append(xs @ ca.t() @ cb.t())
            assert torch.allclose(partials[-1], xs @ row_shard(merged, tp, "test").t())
    if split == "row":
        assert torch.allclose(sum(partials), x @ merged.t())
