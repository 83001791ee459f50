"""Deterministic tiny checkpoints written as complete Hugging Face folders (config.json,
safetensors, tokenizer, chat template, generation config): the embedded default model (with a
tiny Clef head, `make_embedded`), the test fixtures, and random full-size shapes for benchmarks
(`random_tensors` without a folder).

Every tensor, norms and biases included, is random (seeded), so tests that compare logits are
meaningful: a skipped (1 + w), a swapped shard or a transposed weight changes the answer.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from qv.errors import ConfigError
from qv.model.joint_head_layout import HEAD_CONFIG, HEAD_WEIGHTS, SCALARS, HeadConfig, expected_shapes
from qv.model.tiny_tokenizer import tokenizer_json

# The embedded default model's build: bump it whenever what make_embedded writes changes, so that
# builds cached under ~/.cache/qv by an older qv are made again.
EMBEDDED_BUILD = 2
# its Clef head (release layout): one layer of each kind, width 32
EMBEDDED_CLEF_HEAD = dict(width=32, routing_layers=1, layers=1, heads=4, feedforward=64)
# the head's scalars: exp(prior) and exp(joint) scale cosines in [-1, 1] into logits that decide
# without saturating
HEAD_SCALARS = {"prior_logit_scale": 1.5, "joint_logit_scale": 2.0, "residual_gate": 1.0}

# Geometry presets. "layer_types" overrides the every-4th rule when given.
PRESETS: dict[str, dict] = {
    # the embedded default: GQA 6, GDN v/k heads 2, key dim != value dim, partial rotary 0.25, untied, vision
    "tiny": dict(hidden_size=96, intermediate_size=160, num_hidden_layers=4, num_attention_heads=6,
                 num_key_value_heads=1, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=16, linear_value_head_dim=24, partial_rotary_factor=0.25,
                 mrope_section=[2, 1, 1], tie_word_embeddings=False, vision=True),
    # GQA 1, GDN ratio 1, partial rotary 0.5, tied, layer pattern not every-4th, text-only architecture
    "gqa1": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=5, num_attention_heads=2,
                 num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=2,
                 linear_key_head_dim=16, linear_value_head_dim=16, partial_rotary_factor=0.5,
                 mrope_section=[4, 2, 2], tie_word_embeddings=True, vision=False,
                 layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention",
                              "linear_attention"]),
    # GQA 3, GDN ratio 3, dk > dv, partial rotary 0.25, untied, attention every 2nd layer
    "gqa3": dict(hidden_size=48, intermediate_size=96, num_hidden_layers=4, num_attention_heads=6,
                 num_key_value_heads=2, head_dim=16, linear_num_key_heads=1, linear_num_value_heads=3,
                 linear_key_head_dim=32, linear_value_head_dim=16, partial_rotary_factor=0.25,
                 mrope_section=[1, 1, 0], tie_word_embeddings=False, vision=False, full_attention_interval=2),
    # GDN ratio 2 with dk < dv, partial rotary 0.5, tied, vision
    "mixed": dict(hidden_size=80, intermediate_size=144, num_hidden_layers=6, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=8, linear_value_head_dim=20, partial_rotary_factor=0.5,
                  mrope_section=[2, 1, 1], tie_word_embeddings=True, vision=True, full_attention_interval=3),
    # for speculation tests: the "tiny" geometry whose lm_head rows are permuted embeddings, so that
    # greedy decoding mostly walks fixed cycles of `cycle` tokens (a model that repeats lists, which
    # n-gram drafts can match) while attention, GDN and MLP still make it jump between cycles;
    # random weights alone never repeat, and an MTP head can only be fitted to a predictable target
    "spec": dict(hidden_size=96, intermediate_size=160, num_hidden_layers=4, num_attention_heads=6,
                 num_key_value_heads=1, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=16, linear_value_head_dim=24, partial_rotary_factor=0.25,
                 mrope_section=[2, 1, 1], tie_word_embeddings=False, vision=False, cycle=8),
    # benchmark shapes (random weights; write them only where disk allows)
    "0.5b": dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
                 linear_key_head_dim=128, linear_value_head_dim=128, partial_rotary_factor=0.25,
                 mrope_section=[11, 11, 10], tie_word_embeddings=True, vision=False, vocab_size=248320),
    "27b": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24,
                num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
                linear_key_head_dim=128, linear_value_head_dim=128, partial_rotary_factor=0.25,
                mrope_section=[11, 11, 10], tie_word_embeddings=False, vision=False, vocab_size=248320),
}

TINY_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=16,
                   temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=64,
                   hidden_act="gelu_pytorch_tanh", deepstack_visual_indexes=[])


def check_preset(preset: str) -> None:
    """ConfigError (a one-line `qv` error) for a preset that is not in PRESETS."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}: choose from {', '.join(PRESETS)}")


def build_config(preset: str, vocab_size: int, special: dict[str, int], mtp: bool = False) -> dict:
    check_preset(preset)
    p = dict(PRESETS[preset])
    vision = p.pop("vision")
    p.pop("cycle", None)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": p.pop("partial_rotary_factor"),
            "mrope_section": p.pop("mrope_section"), "mrope_interleaved": True}
    interval = p.pop("full_attention_interval", 4)
    n = p["num_hidden_layers"]
    layer_types = p.pop("layer_types", None) or [
        "linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    vocab = p.pop("vocab_size", vocab_size)
    text = dict(model_type="qwen3_5_text", vocab_size=vocab, layer_types=layer_types, rope_parameters=rope,
                rms_norm_eps=1e-6, hidden_act="silu", attn_output_gate=True, attention_bias=False,
                linear_conv_kernel_dim=4, max_position_embeddings=32768, mtp_num_hidden_layers=1 if mtp else 0,
                mtp_use_dedicated_embeddings=False, eos_token_id=special["<|im_end|>"],
                pad_token_id=special["<|endoftext|>"], bos_token_id=None, dtype="float32", **p)
    if not vision:
        text["architectures"] = ["Qwen3_5ForCausalLM"]
        return text
    text.pop("tie_word_embeddings")
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text,
        "vision_config": dict(model_type="qwen3_5_vision", out_hidden_size=p["hidden_size"], **TINY_VISION),
        "image_token_id": special["<|image_pad|>"],
        "video_token_id": special["<|video_pad|>"],
        "vision_start_token_id": special["<|vision_start|>"],
        "vision_end_token_id": special["<|vision_end|>"],
        "tie_word_embeddings": p["tie_word_embeddings"],
        "eos_token_id": special["<|im_end|>"],
        "dtype": "float32",
    }


def _text_cfg(config: dict) -> dict:
    return config.get("text_config", config)


def tensor_shapes(config: dict, mtp: bool = False) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape for every tensor of the architecture (HF names)."""
    t = _text_cfg(config)
    h, inter, v = t["hidden_size"], t["intermediate_size"], t["vocab_size"]
    nh, nkv, d = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
    hk, hv, dk, dv = t["linear_num_key_heads"], t["linear_num_value_heads"], t["linear_key_head_dim"], t["linear_value_head_dim"]
    conv_dim, width = 2 * hk * dk + hv * dv, t["linear_conv_kernel_dim"]
    pre = "model.language_model." if "text_config" in config else "model."
    shapes: dict[str, tuple[int, ...]] = {f"{pre}embed_tokens.weight": (v, h), f"{pre}norm.weight": (h,)}

    def attn(p: str):
        shapes.update({p + "self_attn.q_proj.weight": (2 * nh * d, h), p + "self_attn.k_proj.weight": (nkv * d, h),
                       p + "self_attn.v_proj.weight": (nkv * d, h), p + "self_attn.o_proj.weight": (h, nh * d),
                       p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})

    def mlp_norms(p: str):
        shapes.update({p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                       p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})

    for i, kind in enumerate(t["layer_types"]):
        p = f"{pre}layers.{i}."
        if kind == "full_attention":
            attn(p)
        else:
            g = p + "linear_attn."
            shapes.update({g + "in_proj_qkv.weight": (conv_dim, h), g + "in_proj_z.weight": (hv * dv, h),
                           g + "in_proj_b.weight": (hv, h), g + "in_proj_a.weight": (hv, h),
                           g + "conv1d.weight": (conv_dim, 1, width), g + "A_log": (hv,), g + "dt_bias": (hv,),
                           g + "norm.weight": (dv,), g + "out_proj.weight": (h, hv * dv)})
        mlp_norms(p)
    if not config.get("tie_word_embeddings", t.get("tie_word_embeddings", False)):
        shapes["lm_head.weight"] = (v, h)
    if mtp:
        shapes.update({"mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,),
                       "mtp.pre_fc_norm_hidden.weight": (h,), "mtp.norm.weight": (h,)})
        attn("mtp.layers.0.")
        mlp_norms("mtp.layers.0.")
    if "vision_config" in config:
        shapes.update(_vision_shapes(config["vision_config"]))
    return shapes


def _vision_shapes(vc: dict) -> dict[str, tuple[int, ...]]:
    c, hs, inter = vc["hidden_size"], vc["hidden_size"], vc["intermediate_size"]
    ps, tp, m = vc["patch_size"], vc["temporal_patch_size"], vc["spatial_merge_size"]
    merged = hs * m * m
    s = {"model.visual.patch_embed.proj.weight": (c, vc["in_channels"], tp, ps, ps),
         "model.visual.patch_embed.proj.bias": (c,),
         "model.visual.pos_embed.weight": (vc["num_position_embeddings"], hs),
         "model.visual.merger.norm.weight": (hs,), "model.visual.merger.norm.bias": (hs,),
         "model.visual.merger.linear_fc1.weight": (merged, merged), "model.visual.merger.linear_fc1.bias": (merged,),
         "model.visual.merger.linear_fc2.weight": (vc["out_hidden_size"], merged),
         "model.visual.merger.linear_fc2.bias": (vc["out_hidden_size"],)}
    for i in range(vc["depth"]):
        b = f"model.visual.blocks.{i}."
        s.update({b + "norm1.weight": (hs,), b + "norm1.bias": (hs,), b + "norm2.weight": (hs,), b + "norm2.bias": (hs,),
                  b + "attn.qkv.weight": (3 * hs, hs), b + "attn.qkv.bias": (3 * hs,),
                  b + "attn.proj.weight": (hs, hs), b + "attn.proj.bias": (hs,),
                  b + "mlp.linear_fc1.weight": (inter, hs), b + "mlp.linear_fc1.bias": (inter,),
                  b + "mlp.linear_fc2.weight": (hs, inter), b + "mlp.linear_fc2.bias": (hs,)})
    return s


def random_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator, dtype=torch.float32,
                  device: str | torch.device = "cpu") -> torch.Tensor:
    """A random value for one tensor, scaled by its role so activations stay O(1) through the model."""
    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(0.5, 8.0, generator=gen).log().to(dtype=dtype, device=device)
    if name.endswith("dt_bias"):
        return (torch.rand(shape, generator=gen) * 2 - 1).to(dtype=dtype, device=device)
    if name.endswith(("norm.weight", "layernorm.weight", "norm1.weight", "norm2.weight")) and len(shape) == 1:
        zero_centered = not (name.endswith("linear_attn.norm.weight") or ".visual." in name)
        base = 0.0 if zero_centered else 1.0  # (1 + w) norms vs plain-weight norms
        return (base + 0.2 * torch.randn(shape, generator=gen)).to(dtype=dtype, device=device)
    if name.endswith(".bias"):
        return (0.05 * torch.randn(shape, generator=gen)).to(dtype=dtype, device=device)
    if name.endswith("conv1d.weight"):
        return (0.4 * torch.randn(shape, generator=gen)).to(dtype=dtype, device=device)
    return (weight_std(name, shape) * torch.randn(shape, generator=gen)).to(dtype=dtype, device=device)


def weight_std(name: str, shape: tuple[int, ...]) -> float:
    """The standard deviation of a random matrix: 1 for embeddings, fan_in^-1/2 for linears (unit-scale outputs)."""
    fan_in = math.prod(shape[1:]) if len(shape) > 1 else shape[0]
    return 1.0 if "embed_tokens" in name or "pos_embed" in name else fan_in**-0.5


def random_tensors(config: dict, seed: int = 0, mtp: bool = False, dtype=torch.float32,
                   device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: random_tensor(name, shape, gen, dtype, device)
            for name, shape in sorted(tensor_shapes(config, mtp).items())}


def make_embedded(out_dir: str | Path) -> Path:
    """The embedded default model (what `qv serve` serves without a model): the "tiny" preset,
    seed 0, with a tiny Clef head so that /v1/systemone answers too."""
    return make_tiny(out_dir, "tiny", seed=0, clef_head=True)


def write_clef_head(out: Path, hidden_size: int, seed: int, **geometry) -> None:
    """A random Clef joint schema head in the release layout (joint_head.safetensors and
    joint_head_config.json beside the backbone, the files qv/clef/head.py loads). Every tensor is
    random (seeded), norm gains and biases included; linears fan_in^-1/2, as the backbone's."""
    config = HeadConfig(hidden_size=hidden_size, **geometry)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in sorted(expected_shapes(config).items()):
        if name in SCALARS:
            tensors[name] = torch.tensor(HEAD_SCALARS[name])
        elif "norm" in name:
            tensors[name] = (1.0 if name.endswith("weight") else 0.0) + 0.2 * torch.randn(shape, generator=gen)
        elif name.endswith("bias"):
            tensors[name] = 0.05 * torch.randn(shape, generator=gen)
        else:
            tensors[name] = weight_std(name, shape) * torch.randn(shape, generator=gen)
    save_file(tensors, str(out / HEAD_WEIGHTS), metadata={"format": "pt"})
    (out / HEAD_CONFIG).write_text(config.to_json())


def make_tiny(out_dir: str | Path, preset: str = "tiny", seed: int = 0, mtp: bool = False,
              dtype: torch.dtype = torch.float32, clef_head: bool = False) -> Path:
    """Write a complete tiny checkpoint folder; returns its path. Same arguments, same bytes.
    `dtype` (e.g. bfloat16 for the benchmark shapes) halves what large presets write; `clef_head`
    adds a random Clef head (EMBEDDED_CLEF_HEAD, release layout)."""
    check_preset(preset)  # before anything is written
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _, special = tokenizer_json()
    vocab = max(special.values()) + 1
    vocab = (vocab + 63) // 64 * 64  # padded like real checkpoints (ids past the tokenizer are never produced)
    config = build_config(preset, vocab, special, mtp)
    tensors = random_tensors(config, seed, mtp)
    if "cycle" in PRESETS[preset]:
        _cycle_lm_head(tensors, config, PRESETS[preset]["cycle"], special)
    if dtype != torch.float32:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
        dtype_name = str(dtype).removeprefix("torch.")
        _text_cfg(config)["dtype"] = dtype_name
        if "text_config" in config:
            config["dtype"] = dtype_name
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_tokenizer(out)
    gen_cfg = {"eos_token_id": [special["<|im_end|>"], special["<|endoftext|>"]], "pad_token_id": special["<|endoftext|>"],
               "do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    if "vision_config" in config:
        _write_processor_configs(out, config["vision_config"])
    if clef_head:
        write_clef_head(out, _text_cfg(config)["hidden_size"], seed + 100, **EMBEDDED_CLEF_HEAD)
    return out


def write_tokenizer(out: Path) -> None:
    """The embedded tiny tokenizer and chat template, as tokenizer.json + tokenizer_config.json in `out`."""
    tok_text, _ = tokenizer_json()
    (out / "tokenizer.json").write_text(tok_text)
    template = (Path(__file__).with_name("chat_template.jinja")).read_text()
    tok_cfg = {"tokenizer_class": "Qwen2Tokenizer", "model_max_length": 32768, "eos_token": "<|im_end|>",
               "pad_token": "<|endoftext|>", "bos_token": None, "unk_token": None, "add_bos_token": False,
               "clean_up_tokenization_spaces": False, "errors": "replace", "split_special_tokens": False,
               "chat_template": template}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")


def _cycle_lm_head(tensors: dict[str, torch.Tensor], config: dict, cycle: int, special: dict[str, int]) -> None:
    """lm_head row sigma(t) := embedding of t, with sigma walking blocks of `cycle` token ids in a
    circle (special tokens excluded): the residual stream of token t then scores sigma(t) highest."""
    t = _text_cfg(config)
    embed = tensors["model.embed_tokens.weight"]
    head = torch.randn(embed.shape, generator=torch.Generator().manual_seed(7)) * t["hidden_size"] ** -0.5
    usable = min(special.values()) // cycle * cycle
    ids = torch.arange(usable)
    sigma = ids // cycle * cycle + (ids + 1) % cycle
    head[sigma] = embed[ids] * (4.0 / t["hidden_size"] ** 0.5)
    tensors["lm_head.weight"] = head


def _write_processor_configs(out: Path, vc: dict) -> None:
    """The two processor files in the layout and keys of Qwen3.5's own (Qwen3VLProcessor with
    Qwen2VLImageProcessor and Qwen3VLVideoProcessor), with pixel budgets shrunk to the tiny tower."""
    common = {"patch_size": vc["patch_size"], "temporal_patch_size": vc["temporal_patch_size"],
              "merge_size": vc["spatial_merge_size"], "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
              "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "do_resize": True,
              "do_convert_rgb": True, "resample": 3, "processor_class": "Qwen3VLProcessor"}
    image = dict(common, image_processor_type="Qwen2VLImageProcessor",
                 size={"shortest_edge": 64 * 64, "longest_edge": 512 * 512})
    video = dict(common, video_processor_type="Qwen3VLVideoProcessor",
                 size={"shortest_edge": 64 * 64, "longest_edge": 256 * 256}, fps=2, min_frames=4, max_frames=16,
                 do_sample_frames=True)
    (out / "preprocessor_config.json").write_text(json.dumps(image, indent=2) + "\n")
    (out / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2) + "\n")
