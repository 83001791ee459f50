"""Clef records and LoRA chats in one step: the grouped launch runs Clef's deltas (bank slot 0) and an
adapter's (slot 1) side by side; the record's answers equal the record run alone on an engine without
adapters, and the chats' tokens equal each chat alone."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from clef.clef_records import make_record, max_dp, run_engine  # noqa: E402
from clef.test_clef_engine import NMAX, make_engine  # noqa: E402
from lora_fixtures import write_adapters  # noqa: E402
from qv.clef.request import encode_request  # noqa: E402
from qv.engine.request import SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


def _chat(eng, rid, ids, name):
    eng.add_request(rid, ids, GREEDY, lora_name=name)


def test_records_and_adapter_chats_share_steps(tiny_engine, clef_dirs, tokenizers, tmp_path):
    folder = clef_dirs["adapters"]
    paths = write_adapters(folder, tmp_path)
    rec = encode_request(tokenizers["adapters"], make_record(701, small=True), NMAX)
    alone = run_engine(make_engine(tiny_engine, folder), {"r": rec})["r"].clef.probabilities
    eng = make_engine(tiny_engine, folder, enable_lora=True, lora_modules=f"attn={paths['attn']}", max_lora_rank=16,
                      max_num_batched_tokens=rec.num_tokens + 64)
    chats = {"c-attn": ([5, 9, 33, 120, 7], "attn"), "c-base": ([5, 9, 33, 120, 7], None)}
    for rid, (ids, name) in chats.items():
        _chat(eng, rid, ids, name)
    mixed_steps = []
    prepare = eng.runner.prepare

    def spied(plan):
        st = prepare(plan)
        d = st.batch.delta_rows
        if d is not None and not isinstance(d, torch.Tensor):
            starts = d.slot_start.tolist()
            mixed_steps.append((starts[1] - starts[0], starts[2] - starts[1]))  # (Clef rows, adapter rows)
        return st

    eng.runner.prepare = spied
    done = run_engine(eng, {"r": rec})
    assert any(c and a for c, a in mixed_steps), f"no step held Clef and adapter rows together: {mixed_steps}"
    assert max_dp(done["r"].clef.probabilities, alone) < 1e-6
    eng.runner.prepare = prepare
    for rid, (ids, name) in chats.items():
        _chat(eng, "again", ids, name)
        assert run_engine(eng, {})["again"].outputs[0].token_ids == done[rid].outputs[0].token_ids, rid
    assert done["c-attn"].outputs[0].token_ids != done["c-base"].outputs[0].token_ids
