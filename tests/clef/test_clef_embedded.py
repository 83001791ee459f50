"""The embedded default model's Clef head, written by qv's own code (qv/model/tiny.py, no peft or
clef-finetune), against Cloudflare's JointSchemaHead: the layout qv writes and reads is the state
dict of their head (names and shapes, for several geometries), their head loads the file strictly,
and their `systemone()` on the embedded folder gives qv's answers through the engine."""

from __future__ import annotations

import json

import pytest
import torch

from clef_records import answer_cases
from clef_systemone import systemone_with_probabilities
from test_clef_answers import BOUND, compare

GEOMETRIES = [dict(hidden_size=96, width=32, routing_layers=1, layers=1, heads=4, feedforward=64),
              dict(hidden_size=80, width=48, routing_layers=2, layers=3, heads=6, feedforward=40),
              dict(hidden_size=64, width=16, routing_layers=0, layers=1, heads=2, feedforward=16)]


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_layout_is_joint_schema_heads_state_dict(jsm, geometry):
    from qv.model.joint_head_layout import HeadConfig, expected_shapes

    theirs = {k: tuple(v.shape) for k, v in jsm.JointSchemaHead(**geometry).state_dict().items()}
    assert expected_shapes(HeadConfig(**geometry)) == theirs


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    from qv.model.tiny import make_embedded

    return make_embedded(tmp_path_factory.mktemp("embedded") / "tiny")


def test_embedded_head_is_qvs_own_and_deterministic(embedded, tmp_path):
    from qv.model.tiny import EMBEDDED_CLEF_HEAD, make_embedded

    config = json.loads((embedded / "joint_head_config.json").read_text())
    assert config == dict(hidden_size=96, **EMBEDDED_CLEF_HEAD)
    again = make_embedded(tmp_path / "again")
    for name in ("joint_head.safetensors", "joint_head_config.json", "model.safetensors"):
        assert (again / name).read_bytes() == (embedded / name).read_bytes(), name


def test_embedded_answers_equal_clef_systemone(tiny_engine, jsm, reference_model, embedded):
    """Their ClefModel (transformers' Qwen3_5ForConditionalGeneration + their JointSchemaHead with
    the file loaded strictly) against qv's engine (LLM.decide) on the embedded folder."""
    ref_model, processor = reference_model(embedded)
    llm = tiny_engine(model=embedded, max_model_len=4096, max_num_batched_tokens=512)
    records = answer_cases(3, 8)[:6]
    worst, spread = 0.0, []
    for i, record in enumerate(records):
        ref, raw_ref = systemone_with_probabilities(jsm, ref_model, processor, record)
        rec = llm.encode_clef(record)
        llm.engine.add_clef(f"r{i}", rec)
        out = {}
        while llm.engine.has_unfinished_requests():
            out.update((o.request_id, o) for o in llm.engine.step() if o.finished)
        raw = out[f"r{i}"].clef.probabilities
        worst = max(worst, compare(llm.decide(record), ref, raw, raw_ref))
        spread += [p for q in raw_ref for p in q]
    print(f"\nembedded Clef head: {len(records)} records, max |dp| {worst:.2e} vs Clef systemone")
    assert worst <= BOUND
    assert torch.tensor(spread).std() > 0.01  # the answers are not all uniform
