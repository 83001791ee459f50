"""Oracle: qv's hybrid model (fp32, reference ops) against Hugging Face transformers'
Qwen3_5ForCausalLM / Qwen3_5ForConditionalGeneration on the same checkpoint folder.

transformers runs in float64 (its own fp32 drifts ~3e-6 from float64), so the bound below
measures qv's error alone. Prompts are random and fresh each run; the seed is printed on failure.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from qv.config import ModelConfig
from qv.model.batch import build_step_batch
from qv.model.cache import allocate_cache
from qv.model.qwen3_5 import load_text_model
from qv.model.tiny import build_config
from qv.model.tiny_tokenizer import tokenizer_json
from util import assert_close

BOUND = 1e-5
ORACLE_PRESETS = ("tiny", "gqa1", "gqa3", "mixed")


def qv_logits(model_dir, ids: torch.Tensor) -> torch.Tensor:
    """Logits [T, vocab] of every position of one sequence, in one step."""
    model = load_text_model(str(model_dir))
    t, bs = ids.numel(), 16
    blocks = list(range((t + bs - 1) // bs))
    batch = build_step_batch([t], [t], [blocks], [0], bs, logits_rows=list(range(t)))
    cache = allocate_cache(model.cfg, len(blocks), bs, 1, torch.float32, torch.float32, torch.float32, "cpu")
    hidden = model.forward(ids, torch.arange(t), batch, cache)
    return model.compute_logits(hidden[batch.logits_indices])


def hf_logits(model_dir, ids: torch.Tensor) -> torch.Tensor:
    """transformers' logits in float64; also asserts the folder is a complete HF checkpoint."""
    import transformers

    raw = json.loads((model_dir / "config.json").read_text())
    cls = getattr(transformers, raw["architectures"][0])
    model, info = cls.from_pretrained(str(model_dir), dtype=torch.float64, output_loading_info=True)
    # A missing key would be randomly initialised by HF and compared against qv's real tensor: the
    # comparison would fail for the wrong reason, or pass on a fixture that is not a real checkpoint.
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        return model(input_ids=ids[None]).logits[0]


def test_presets_cover_the_required_geometries():
    """The issue names geometries the oracle must cover; check the presets really do."""
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
    gen = torch.Generator().manual_seed(seed)
    folder = tiny_dirs(preset, seed=seed % 3)  # weights vary too, within the fixture cache
    vocab = ModelConfig.from_dir(folder).vocab_size
    t = 5 + seed % 60  # lengths below and above a KV block (16) and a GDN chunk
    ids = torch.randint(0, vocab, (t,), generator=gen)
    ours, ref = qv_logits(folder, ids), hf_logits(folder, ids)
    err = assert_close(f"{preset} logits (seed {seed}, {t} tokens)", ours, ref, BOUND)
    print(f"{preset}: rel err {err:.2e} (seed {seed}, {t} tokens)")
