"""Checkpoints as users bring them: a config.json that leaves keys out means what it means to
transformers. Each optional key is removed from the tiny fixtures' configs in turn and qv's parsed
config is compared with what transformers' config and modeling code read; then the logits of
configs lacking keys are compared with transformers' (float64), an image prompt for mRoPE."""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_oracle import assert_matches_hf
from qv.config import ConfigError, ModelConfig
from qv.kernels.rope.reference import rope_angles
from qv.model_config import TEXT_DEFAULTS, TOKEN_DEFAULTS, VISION_DEFAULTS
from util import assert_close, rel_err

ROPE_KEYS = ("rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved", "rope_type")
TEXT_KEYS = sorted(set(TEXT_DEFAULTS) - {"full_attention_interval"}) + ["layer_types", "rope_parameters"]
CASES = ([("tiny", "text", k) for k in TEXT_KEYS] + [("tiny", "rope", k) for k in ROPE_KEYS]
         + [("tiny", "top", k) for k in TOKEN_DEFAULTS] + [("tiny", "vision", k) for k in VISION_DEFAULTS]
         + [("gqa1", "text", k) for k in TEXT_KEYS] + [("gqa1", "rope", k) for k in ROPE_KEYS])


def _config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def _drop(config: dict, where: str, key: str) -> dict:
    config = copy.deepcopy(config)
    text = config.get("text_config", config)
    {"text": text, "rope": text.get("rope_parameters", {}), "top": config,
     "vision": config.get("vision_config", {})}[where].pop(key, None)
    return config


def _folder(tmp_path: Path, source: Path, config: dict) -> Path:
    """A copy of a fixture folder with another config.json."""
    out = tmp_path / f"{source.name}-edited"
    shutil.copytree(source, out, dirs_exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    return out


def transformers_reading(folder: Path) -> dict:
    """What transformers' Qwen3.5 code takes from the folder's config, in qv's field names."""
    from transformers import AutoConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    hf = AutoConfig.from_pretrained(folder)
    t = hf.get_text_config()
    rotary = Qwen3_5TextRotaryEmbedding(t)  # the modeling code's own defaults (mrope_section)
    out = {k: getattr(t, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                      "num_attention_heads", "num_key_value_heads", "head_dim", "linear_num_key_heads",
                                      "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                                      "linear_conv_kernel_dim", "rms_norm_eps", "max_position_embeddings",
                                      "hidden_act", "attention_bias")}
    out.update(layer_types=tuple(t.layer_types), rope_theta=t.rope_parameters["rope_theta"],
               rotary_dim=2 * rotary.inv_freq.numel(), inv_freq=rotary.inv_freq,
               mrope_section=tuple(rotary.mrope_section), mrope_interleaved=True)  # its mRoPE is always interleaved
    if hf.model_type == "qwen3_5":
        out.update({k: getattr(hf, k) for k in TOKEN_DEFAULTS})
        v = hf.vision_config
        out["vision"] = tuple(getattr(v, k) for k in VISION_DEFAULTS)
    return out


def inconsistent(ref: dict) -> str | None:
    """The geometry rule transformers' reading breaks (ConfigError's words), if any."""
    if len(ref["layer_types"]) != ref["num_hidden_layers"]:
        return "layer_types has"
    if ref["num_attention_heads"] % ref["num_key_value_heads"]:
        return "num_attention_heads must be a multiple"
    if ref["linear_num_value_heads"] % ref["linear_num_key_heads"]:
        return "linear_num_value_heads must be a multiple"
    return None


def qv_reading(cfg: ModelConfig, keys) -> dict:
    out = {k: getattr(cfg, k) for k in keys if k not in ("rotary_dim", "inv_freq", "vision")}
    out["rotary_dim"] = cfg.rotary_dim
    if "vision" in keys:
        out["vision"] = tuple(getattr(cfg.vision, k) for k in VISION_DEFAULTS)
    return out


@pytest.mark.parametrize("preset,where,key", CASES, ids=[f"{p}-{w}-{k}" for p, w, k in CASES])
def test_missing_key_reads_as_transformers(tiny_dirs, tmp_path, preset, where, key):
    source = tiny_dirs(preset)
    config = _drop(_config(source), where, key)
    folder = tmp_path / "cfg"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    try:
        ref = transformers_reading(folder)
    except Exception as exc:  # noqa: BLE001 - transformers refuses the config (its strict dataclass error)
        with pytest.raises(ConfigError, match="layer_types has"):
            ModelConfig.from_dir(folder)
        assert "layer_types" in str(exc)
        return
    broken = inconsistent(ref)
    if broken:  # the default does not fit the keys left (transformers' model could not be built either)
        with pytest.raises(ConfigError, match=broken):
            ModelConfig.from_dir(folder)
        return
    cfg = ModelConfig.from_dir(folder)
    assert qv_reading(cfg, ref) == {k: v for k, v in ref.items() if k != "inv_freq"}
    ours = rope_angles(torch.tensor([1]), cfg.rotary_dim, cfg.rope_theta)[0]  # angles at position 1: the frequencies
    assert torch.allclose(ours, ref["inv_freq"].float(), rtol=1e-6)


@pytest.mark.parametrize("flags,tied", [({"top": True}, True), ({"text": True}, False), ({"text": True, "top": False}, False),
                                        ({"text": False, "top": True}, True), ({}, False)])
def test_multimodal_ties_by_the_top_level_flag(tiny_dirs, flags, tied):
    """transformers' Qwen3_5ForConditionalGeneration ties lm_head by the top-level flag only."""
    import transformers

    config = _config(tiny_dirs("tiny"))
    config.pop("tie_word_embeddings")
    config["text_config"].pop("tie_word_embeddings", None)
    if "top" in flags:
        config["tie_word_embeddings"] = flags["top"]
    if "text" in flags:
        config["text_config"]["tie_word_embeddings"] = flags["text"]
    with torch.device("meta"):
        hf = transformers.Qwen3_5ForConditionalGeneration(transformers.Qwen3_5Config.from_dict(config))
    assert (hf.lm_head.weight is hf.model.language_model.embed_tokens.weight) is tied
    assert ModelConfig.from_dict(config).tie_word_embeddings is tied


# keys whose transformers default fits the fixtures' weights, removed all at once
HARMLESS = [("text", k) for k in ("rms_norm_eps", "hidden_act", "attention_bias", "max_position_embeddings",
                                  "linear_conv_kernel_dim", "layer_types")] + \
           [("rope", k) for k in ("rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved",
                                  "rope_type")]


@pytest.mark.parametrize("preset", ["tiny", "gqa1", "mixed"])
def test_text_logits_without_optional_keys(tiny_dirs, tmp_path, preset):
    """gqa1 and mixed have partial_rotary_factor 0.5: without it both take 0.25."""
    source = tiny_dirs(preset)
    config = _config(source)
    types = config.get("text_config", config)["layer_types"]
    every_4th = types == ["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(len(types))]
    for where, key in HARMLESS:
        if key != "layer_types" or every_4th:  # other patterns: the weights follow the config's list
            config = _drop(config, where, key)
    folder = _folder(tmp_path, source, config)
    cfg = ModelConfig.from_dir(folder)
    assert cfg.rope_theta == 10000.0 and cfg.partial_rotary_factor == 0.25 and cfg.mrope_section == (11, 11, 10)
    ids = torch.tensor(np.random.default_rng(7).integers(0, 300, 40))
    assert_matches_hf(folder, folder, ids, f"{preset} without optional keys")


def _image_case(folder: Path, rng_seed: int = 1):
    """(prompt ids, VisionItem) of a text + image + text prompt for the folder's tokenizer."""
    from transformers import AutoTokenizer

    from qv.model.vision_processor import VisionProcessor, VisionTokenIds, expand_vision_tokens

    tok, cfg = AutoTokenizer.from_pretrained(folder), ModelConfig.from_dir(folder)
    image = np.random.default_rng(rng_seed).integers(0, 256, (128, 160, 3), dtype=np.uint8)
    item = VisionProcessor.from_dir(folder).image(image)
    text = "Describe <|vision_start|><|image_pad|><|vision_end|> briefly, please."
    marks = VisionTokenIds(cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id)
    ids = expand_vision_tokens(tok(text)["input_ids"], [item], marks,
                               lambda s: tok(s, add_special_tokens=False)["input_ids"])
    return torch.tensor(ids), item


@torch.no_grad()
def _qv_image_logits(folder: Path, cfg: ModelConfig, ids: torch.Tensor, item) -> torch.Tensor:
    from qv.model.batch import build_step_batch
    from qv.model.cache import allocate_cache
    from qv.model.vision import load_multimodal_model
    from qv.model.vision_inputs import embed_with_vision, mrope_positions

    text, tower = load_multimodal_model(folder, cfg)
    pos, _ = mrope_positions(ids, [item.grid_thw], [], cfg.image_token_id, cfg.video_token_id,
                             cfg.vision.spatial_merge_size)
    t, bs = ids.numel(), 16
    blocks = list(range(-(-t // bs)))
    cache = allocate_cache(cfg, len(blocks), bs, 1, torch.float32, torch.float32, torch.float32, "cpu")
    embeds = embed_with_vision(text.embed, ids, tower(item.pixel_values, [item.grid_thw]),
                               (cfg.image_token_id, cfg.video_token_id))
    batch = build_step_batch([t], [t], [blocks], [0], bs, logits_rows=list(range(t)))
    return text.compute_logits(text.forward(ids, pos, batch, cache, inputs_embeds=embeds))


@pytest.mark.parametrize("preset", ["tiny"])  # mixed's fp32 noise on image rows passes 1e-5 (tests/hf_oracle.py)
@pytest.mark.parametrize("dropped", [("mrope_section", "mrope_interleaved"), ("mrope_interleaved",)],
                         ids=["section-and-layout", "layout"])
def test_image_logits_without_mrope_keys(tiny_dirs, tmp_path, preset, dropped):
    """Without mrope_section transformers rotates image tokens by interleaved [11, 11, 10] mRoPE
    (and without mrope_interleaved, interleaved): qv's prefill logits over an image prompt equal
    its float64 ones. Control: plain RoPE for the image tokens (qv's reading before) is far off."""
    from transformers import Qwen3_5ForConditionalGeneration

    source = tiny_dirs(preset)
    config = _config(source)
    for key in dropped:
        config = _drop(config, "rope", key)
    folder = _folder(tmp_path, source, config)
    cfg = ModelConfig.from_dir(folder)
    assert cfg.mrope_interleaved and cfg.mrope_section == (tuple(_config(source)["text_config"]["rope_parameters"][
        "mrope_section"]) if "mrope_section" not in dropped else (11, 11, 10))
    ids, item = _image_case(folder)
    pad = cfg.image_token_id
    hf = Qwen3_5ForConditionalGeneration.from_pretrained(folder, dtype=torch.float64).eval()
    with torch.no_grad():
        ref = hf(input_ids=ids[None], pixel_values=item.pixel_values.double(),
                 image_grid_thw=torch.tensor([item.grid_thw]), mm_token_type_ids=(ids == pad).long()[None]).logits[0]
    ours = _qv_image_logits(folder, cfg, ids, item)
    assert_close(f"{preset} image prompt without {', '.join(dropped)}", ours, ref, 1e-5)
    plain = _qv_image_logits(folder, dataclasses.replace(cfg, mrope_section=None), ids, item)
    assert rel_err(plain, ref) > 1e-4, "plain RoPE was meant to move the logits past the bound"
    contiguous = _qv_image_logits(folder, dataclasses.replace(cfg, mrope_interleaved=False, mrope_section=(2, 1, 1)),
                                  ids, item)
    assert rel_err(contiguous, ref) > 1e-4, "contiguous sections were meant to move the logits past the bound"
