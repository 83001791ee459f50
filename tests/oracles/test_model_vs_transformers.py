"""Oracle: qv's hybrid model (fp32, reference ops) against Hugging Face transformers'
Qwen3_5ForCausalLM / Qwen3_5ForConditionalGeneration on the same checkpoint folder.

transformers runs in float64 (its own fp32 drifts ~3e-6 from float64), so the bound measures
qv's error alone; tests/hf_oracle.py holds the comparison and explains the one allowance (inputs
that are ill-conditioned in fp32). Prompts and weights are random, from the test's fixed seed (`pytest
--seed N` draws others); the seed is in the failure message.
"""

from __future__ import annotations

import random

import pytest
import torch

from hf_oracle import BOUND, assert_matches_hf
from qv.config import ModelConfig
from qv.model.tiny import build_config
from qv.model.tiny_tokenizer import tokenizer_json

ORACLE_PRESETS = ("tiny", "gqa1", "gqa3", "mixed")


def test_presets_cover_the_required_geometries():
    """The issue names the geometries the oracle must cover; check the presets really do."""
    _, special = tokenizer_json()
    cfgs = {name: ModelConfig.from_dict(build_config(name, 256, special)) for name in ORACLE_PRESETS}
    gqa = {c.num_attention_heads // c.num_key_value_heads for c in cfgs.values()}
    gdn = {c.linear_num_value_heads // c.linear_num_key_heads for c in cfgs.values()}
    assert {1, 3, 6} <= gqa, gqa
    assert {1, 2, 3} <= gdn, gdn
    assert any(c.linear_key_head_dim != c.linear_value_head_dim for c in cfgs.values())
    assert {0.25, 0.5} <= {c.partial_rotary_factor for c in cfgs.values()}
    assert {True, False} == {c.tie_word_embeddings for c in cfgs.values()}
    every_4th = lambda c: all((t == "full_attention") == ((i + 1) % 4 == 0) for i, t in enumerate(c.layer_types))  # noqa: E731
    assert any(not every_4th(c) for c in cfgs.values())
    assert {"Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"} == {c.architecture for c in cfgs.values()}


@pytest.mark.parametrize("preset", ORACLE_PRESETS)
def test_logits_match_transformers(tiny_dirs, preset):
    seed = random.randrange(2**31)
    folder = tiny_dirs(preset, seed=seed % 3)  # the weights vary too (within the session's fixture cache)
    vocab = ModelConfig.from_dir(folder).vocab_size
    t = 5 + seed % 60  # below and above a KV block (16 tokens)
    ids = torch.randint(0, vocab, (t,), generator=torch.Generator().manual_seed(seed))
    err, noise = assert_matches_hf(folder, folder, ids, f"{preset} logits (seed {seed}, {t} tokens)")
    print(f"{preset}: rel err {err:.2e}" + ("" if noise is None else f" (>= {BOUND:.0e}; fp32 noise {noise:.2e})"))
