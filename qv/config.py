"""Configuration: the model (parsed from a Hugging Face config.json) and every engine lever.

Every `QV_*` environment variable is declared once in `EngineConfig` below, with its default
and meaning, and read only by `EngineConfig.from_env`. `docs/LEVERS.md` is generated from this
table (`python -m qv.config > docs/LEVERS.md`; a test checks it is current). Components take
the scalars they need, never the whole config.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM")
SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")


class ConfigError(ValueError):
    """A checkpoint config or a lever value that qv cannot use; the message names the cause."""


# --------------------------------------------------------------------------------------------
# Model config
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantConfig:
    """GPTQ settings from `quantization_config` (or `quantize_config.json`)."""

    bits: int
    group_size: int  # -1: one group over the whole input dim
    sym: bool
    desc_act: bool
    checkpoint_format: str  # "gptq" (zero stored minus one) or "gptq_v2" (true zero)
    dynamic: dict[str, dict]  # "-:regex" excludes modules; "+:regex"/"regex" overrides
    modules_to_not_convert: tuple[str, ...]
    lm_head: bool


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    hidden_act: str
    deepstack_visual_indexes: tuple[int, ...]


@dataclass(frozen=True)
class ModelConfig:
    """The text model's geometry, plus the optional vision tower and quantization settings."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]  # "linear_attention" (GDN) or "full_attention"
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    mrope_section: tuple[int, ...] | None
    mrope_interleaved: bool
    attn_output_gate: bool
    attention_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    hidden_act: str
    eos_token_ids: tuple[int, ...]
    mtp_num_hidden_layers: int
    image_token_id: int | None
    video_token_id: int | None
    vision_start_token_id: int | None
    vision_end_token_id: int | None
    vision: VisionConfig | None
    quant: QuantConfig | None
    torch_dtype: str | None

    # ---- derived geometry -------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def attention_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def gdn_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def weight_prefix(self) -> str:
        """Checkpoint prefix of the text model's tensors."""
        if self.architecture == "Qwen3_5ForConditionalGeneration":
            return "model.language_model."
        return "model."

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"no config.json in {model_dir}")
        with open(path) as f:
            raw = json.load(f)
        quant = raw.get("quantization_config")
        if quant is None and (Path(model_dir) / "quantize_config.json").is_file():
            with open(Path(model_dir) / "quantize_config.json") as f:
                quant = json.load(f)
        return cls.from_dict(raw, quant_override=quant)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], quant_override: dict | None = None) -> "ModelConfig":
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unsupported model_type {model_type!r}: qv serves {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        archs = raw.get("architectures") or [
            "Qwen3_5ForConditionalGeneration" if model_type == "qwen3_5" else "Qwen3_5ForCausalLM"
        ]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unsupported architecture {arch!r}: qv serves {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if model_type == "qwen3_5":
            text = raw.get("text_config")
            if not isinstance(text, dict):
                raise ConfigError("config.json of model_type 'qwen3_5' lacks a 'text_config' object")
        else:
            text = raw
        return _parse_text(raw, text, arch, quant_override)


_REQUIRED_TEXT = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)


def _parse_text(top: dict, text: dict, arch: str, quant_override: dict | None) -> ModelConfig:
    missing = [k for k in _REQUIRED_TEXT if k not in text]
    if missing:
        raise ConfigError(f"config.json lacks required text fields: {', '.join(missing)}")
    n_layers = int(text["num_hidden_layers"])
    layer_types = text.get("layer_types")
    if layer_types is None:
        interval = int(text.get("full_attention_interval", 4))
        layer_types = [
            "linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layers)
        ]
    layer_types = tuple(layer_types)
    if len(layer_types) != n_layers:
        raise ConfigError(f"layer_types has {len(layer_types)} entries but num_hidden_layers is {n_layers}")
    bad = sorted(set(layer_types) - {"linear_attention", "full_attention"})
    if bad:
        raise ConfigError(f"unknown layer types {bad}: expected 'linear_attention' or 'full_attention'")

    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise ConfigError(f"unsupported rope_type {rope_type!r}: qv implements default/mrope rotary")
    theta = rope.get("rope_theta", text.get("rope_theta"))
    if theta is None:
        raise ConfigError("config.json lacks rope_theta (in rope_parameters or the text config)")
    prf = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
    section = rope.get("mrope_section")

    heads = int(text["num_attention_heads"])
    head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
    if heads % int(text["num_key_value_heads"]):
        raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
    if int(text["linear_num_value_heads"]) % int(text["linear_num_key_heads"]):
        raise ConfigError("linear_num_value_heads must be a multiple of linear_num_key_heads")
    if section is not None and 2 * sum(section) != int(head_dim * prf):
        raise ConfigError(
            f"mrope_section {section} sums to {sum(section)}, expected rotary_dim/2 = {int(head_dim * prf) // 2}"
        )

    eos = text.get("eos_token_id", top.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))

    vision = _parse_vision(top.get("vision_config")) if arch == "Qwen3_5ForConditionalGeneration" else None
    quant_raw = quant_override if quant_override is not None else top.get("quantization_config")
    tie = bool(text.get("tie_word_embeddings", top.get("tie_word_embeddings", False)))
    return ModelConfig(
        architecture=arch,
        vocab_size=int(text["vocab_size"]),
        hidden_size=int(text["hidden_size"]),
        intermediate_size=int(text["intermediate_size"]),
        num_hidden_layers=n_layers,
        layer_types=layer_types,
        num_attention_heads=heads,
        num_key_value_heads=int(text["num_key_value_heads"]),
        head_dim=head_dim,
        linear_num_key_heads=int(text["linear_num_key_heads"]),
        linear_num_value_heads=int(text["linear_num_value_heads"]),
        linear_key_head_dim=int(text["linear_key_head_dim"]),
        linear_value_head_dim=int(text["linear_value_head_dim"]),
        linear_conv_kernel_dim=int(text["linear_conv_kernel_dim"]),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        partial_rotary_factor=float(prf),
        mrope_section=tuple(section) if section else None,
        mrope_interleaved=bool(rope.get("mrope_interleaved", False)),
        attn_output_gate=bool(text.get("attn_output_gate", True)),
        attention_bias=bool(text.get("attention_bias", False)),
        tie_word_embeddings=tie,
        max_position_embeddings=int(text.get("max_position_embeddings", 262144)),
        hidden_act=str(text.get("hidden_act", "silu")),
        eos_token_ids=eos_ids,
        mtp_num_hidden_layers=int(text.get("mtp_num_hidden_layers", 0)),
        image_token_id=top.get("image_token_id"),
        video_token_id=top.get("video_token_id"),
        vision_start_token_id=top.get("vision_start_token_id"),
        vision_end_token_id=top.get("vision_end_token_id"),
        vision=vision,
        quant=_parse_quant(quant_raw) if quant_raw else None,
        torch_dtype=text.get("dtype", text.get("torch_dtype", top.get("dtype", top.get("torch_dtype")))),
    )


def _parse_vision(raw: dict | None) -> VisionConfig | None:
    if not raw:
        return None
    patch = raw.get("patch_size", 16)
    tpatch = raw.get("temporal_patch_size", 2)
    return VisionConfig(
        depth=int(raw.get("depth", raw.get("num_hidden_layers", 27))),
        hidden_size=int(raw.get("hidden_size", 1152)),
        intermediate_size=int(raw.get("intermediate_size", 4304)),
        num_heads=int(raw.get("num_heads", raw.get("num_attention_heads", 16))),
        in_channels=int(raw.get("in_channels", 3)),
        patch_size=int(patch[0] if isinstance(patch, (list, tuple)) else patch),
        temporal_patch_size=int(tpatch[0] if isinstance(tpatch, (list, tuple)) else tpatch),
        spatial_merge_size=int(raw.get("spatial_merge_size", 2)),
        out_hidden_size=int(raw.get("out_hidden_size", 3584)),
        num_position_embeddings=int(raw.get("num_position_embeddings", 2304)),
        hidden_act=str(raw.get("hidden_act", "gelu_pytorch_tanh")),
        deepstack_visual_indexes=tuple(raw.get("deepstack_visual_indexes") or ()),
    )


def _parse_quant(raw: dict) -> QuantConfig:
    method = raw.get("quant_method", "gptq")
    if method != "gptq":
        raise ConfigError(f"unsupported quant_method {method!r}: qv loads GPTQ checkpoints")
    bits = int(raw.get("bits", 8))
    if bits != 8:
        raise ConfigError(f"GPTQ bits={bits} is not supported: qv loads GPTQ-Int8 (bits=8)")
    fmt = raw.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ConfigError(f"unsupported GPTQ checkpoint_format {fmt!r}: expected 'gptq' or 'gptq_v2'")
    group_size = int(raw.get("group_size", 128))
    if group_size == 0 or group_size < -1:
        raise ConfigError(f"GPTQ group_size={group_size}: expected a positive group size or -1 (one group)")
    return QuantConfig(
        bits=bits,
        group_size=group_size,
        sym=_json_bool(raw, "sym", True),
        desc_act=_json_bool(raw, "desc_act", False),
        checkpoint_format=fmt,
        dynamic=dict(raw.get("dynamic") or {}),
        modules_to_not_convert=tuple(raw.get("modules_to_not_convert") or ()),
        lm_head=_json_bool(raw, "lm_head", False),
    )


def _json_bool(raw: dict, key: str, default: bool) -> bool:
    """A JSON boolean; strings like "false" are refused rather than read as truthy."""
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"quantization_config.{key}={value!r}: expected true or false")
    return value


# --------------------------------------------------------------------------------------------
# Engine levers
# --------------------------------------------------------------------------------------------


def lever(default: Any, doc: str, env: str | None = None, choices: tuple | None = None):
    """One lever: a typed field with its environment variable, default and one-line meaning."""
    return field(default=default, metadata={"doc": doc, "env": env, "choices": choices})


@dataclass
class EngineConfig:
    # -- model and device ----------------------------------------------------------------------
    model: str | None = lever(None, "Checkpoint folder; unset serves the embedded tiny default model.", "QV_MODEL")
    device: str = lever("auto", "auto: CUDA when present, else CPU; or cpu, cuda, cuda:N.", "QV_DEVICE")
    dtype: str = lever(
        "auto",
        "Activation dtype. auto: float16 on sm_70, bfloat16 on sm_80+, float32 on CPU.",
        "QV_DTYPE",
        ("auto", "float32", "float16", "bfloat16"),
    )
    kernels: str = lever(
        "auto",
        "Op implementations: auto (triton on CUDA, reference on CPU), reference, triton, sm70.",
        "QV_KERNELS",
        ("auto", "reference", "triton", "sm70"),
    )
    seed: int = lever(0, "Seed for weight-free randomness (sampling without a per-request seed).", "QV_SEED")
    load_format: str = lever(
        "auto",
        "auto: read the checkpoint's safetensors; random: make weights on the device in the layout the checkpoint "
        "would load into (vLLM's dummy format, for benchmarks: a folder with only config.json serves).",
        "QV_LOAD_FORMAT",
        ("auto", "random"),
    )
    quantization: str = lever(
        "auto",
        "auto: as the checkpoint's quantization_config says; gptq-int8: with load_format random, GPTQ-Int8 "
        "(symmetric, group 128) for a config without one.",
        "QV_QUANTIZATION",
        ("auto", "gptq-int8"),
    )
    # -- capacity ------------------------------------------------------------------------------
    max_model_len: int = lever(0, "Longest sequence (prompt + output); 0: the model's max_position_embeddings.", "QV_MAX_MODEL_LEN")
    max_num_seqs: int = lever(64, "Most sequences running in one step.", "QV_MAX_NUM_SEQS")
    max_num_batched_tokens: int = lever(2048, "Token budget of one step (prefill chunks + decodes).", "QV_MAX_NUM_BATCHED_TOKENS")
    kv_cache_bytes: int = lever(0, "Bytes for attention KV blocks and GDN prefix snapshots; 0: derived from gpu_memory_utilization (CPU: 256 MiB).", "QV_KV_CACHE_BYTES")
    gpu_memory_utilization: float = lever(0.90, "Share of GPU memory qv may plan for when kv_cache_bytes is 0.", "QV_GPU_MEMORY_UTILIZATION")
    block_size: int = lever(16, "Tokens per KV block.", "QV_BLOCK_SIZE")
    kv_dtype: str = lever(
        "auto",
        "KV cache storage: auto (activation dtype), fp16, bf16, int8 (symmetric, fp32 scale per token and KV head).",
        "QV_KV_DTYPE",
        ("auto", "fp16", "bf16", "int8"),
    )
    gdn_state_dtype: str = lever(
        "fp32",
        "Gated DeltaNet recurrent state storage: fp32, fp16, int16 (uniform grid with a scale per column).",
        "QV_GDN_STATE_DTYPE",
        ("fp32", "fp16", "int16"),
    )
    max_gdn_slots: int = lever(0, "GDN state slots (one per running sequence); 0: max_num_seqs.", "QV_MAX_GDN_SLOTS")
    cuda_graphs: bool = lever(True, "Replay captured CUDA graphs for decode steps; a graph that disagrees with the eager "
                              "forward at start-up stops the engine (0: decode runs eagerly).", "QV_CUDA_GRAPHS")
    async_scheduling: bool = lever(
        True,
        "Overlap the host work of a decode step with the GPU's: the next step is scheduled and launched before the "
        "last one's tokens reach the host (their ids go from the device into the next step's inputs; the row of a "
        "sequence that stopped is dropped). Tokens, text and finish reasons are the synchronous engine's, logprobs "
        "too up to fp32 rounding where the batches differ; with speculative decoding, Clef records, images/videos, "
        "penalties, or a plan that could preempt, a step waits for the last one's tokens (0: every step waits).",
        "QV_ASYNC_SCHEDULING",
    )
    long_prefill_token_threshold: int = lever(
        0,
        "A prefill with more prompt tokens left than this is long. While other sequences decode, a long prefill "
        "(a Clef record or a long chat prompt) takes at most this many tokens of a step; alone it takes the whole "
        "budget (vLLM's name). 0: max_num_batched_tokens // 4.",
        "QV_LONG_PREFILL_TOKEN_THRESHOLD",
    )
    max_long_partial_prefills: int = lever(
        1, "Most long prefills that share one step with decoding sequences (vLLM's name).",
        "QV_MAX_LONG_PARTIAL_PREFILLS",
    )
    # -- prefix caching ------------------------------------------------------------------------
    prefix_caching: bool = lever(True, "Reuse KV blocks and GDN state snapshots of earlier prompts.", "QV_PREFIX_CACHING")
    gdn_snapshot_interval: int = lever(
        0,
        "Tokens between GDN state snapshots for prefix reuse (a multiple of block_size; hits round down to it); "
        "0: the smallest multiple of 64 blocks at which snapshots cost at most half the KV bytes per token.",
        "QV_GDN_SNAPSHOT_INTERVAL",
    )
    prefix_cache_chat_reserve: float = lever(
        0.2, "Share of KV blocks whose cached chat prefixes Clef records may not evict (Clef rows hold at most the rest).",
        "QV_PREFIX_CACHE_CHAT_RESERVE",
    )
    kv_offload_bytes: int = lever(0, "Pinned host memory for evicted KV blocks and snapshots; 0: off.", "QV_KV_OFFLOAD_BYTES")
    # -- speculative decoding -------------------------------------------------------------------
    spec: str = lever("off", "Speculative decoding: off, mtp, ngram, auto.", "QV_SPEC", ("off", "mtp", "ngram", "auto"))
    spec_k: int = lever(3, "Draft tokens per step.", "QV_SPEC_K")
    spec_max_seqs: int = lever(16, "Most sequences verifying drafts in one step (each keeps k+1 GDN states).", "QV_SPEC_MAX_SEQS")
    # -- server ----------------------------------------------------------------------------------
    host: str = lever("127.0.0.1", "Listen address of `qv serve`.", "QV_HOST")
    port: int = lever(8000, "Listen port of `qv serve`.", "QV_PORT")
    served_model_name: str = lever("", "Comma-separated model names the API answers to; empty: the folder name.", "QV_SERVED_MODEL_NAME")
    api_key: str = lever("", "If set, every route but /health requires `Authorization: Bearer <key>`.", "QV_API_KEY")
    metrics_public: bool = lever(False, "With api_key set, /metrics answers without the key too (for a scraper).",
                                 "QV_METRICS_PUBLIC")
    enable_thinking: bool = lever(False, "Default enable_thinking for the chat template (per-request override).", "QV_ENABLE_THINKING")
    max_body_bytes: int = lever(32 << 20, "Largest request body; larger gets 413.", "QV_MAX_BODY_BYTES")
    max_waiting: int = lever(1024, "Most sequences waiting (prompts x n, counted at admission); a request that would "
                             "pass it gets 503 with Retry-After.", "QV_MAX_WAITING")
    max_prompts_per_request: int = lever(256, "Most prompts in one /v1/completions request.", "QV_MAX_PROMPTS_PER_REQUEST")
    max_stop_strings: int = lever(64, "Most stop strings in one request.", "QV_MAX_STOP_STRINGS")
    body_read_timeout_s: float = lever(30.0, "Longest wait for a request body to arrive whole; slower gets 408.",
                                       "QV_BODY_READ_TIMEOUT_S")
    shutdown_grace_s: float = lever(10.0, "On SIGTERM: new requests get 503 while generations in flight may finish for "
                                    "this long; then streams get a final error event and [DONE] and the process exits.",
                                    "QV_SHUTDOWN_GRACE_S")
    state_dir: str = lever("", "Directory for compiled kernels (Triton, CuPy) and repacked weights, reused by the next "
                           "start; empty: ~/.cache/qv.", "QV_STATE_DIR")
    max_logprobs: int = lever(20, "Most top logprobs a request may ask for.", "QV_MAX_LOGPROBS")
    # -- media -----------------------------------------------------------------------------------
    media_max_images: int = lever(20, "Most images per chat request (0 with media_max_videos 0: the vision tower is "
                                  "not loaded).", "QV_MEDIA_MAX_IMAGES")
    media_max_videos: int = lever(2, "Most videos per chat request.", "QV_MEDIA_MAX_VIDEOS")
    media_max_bytes: int = lever(20 << 20, "Largest fetched media file.", "QV_MEDIA_MAX_BYTES")
    media_timeout_s: float = lever(10.0, "Timeout for fetching one media URL.", "QV_MEDIA_TIMEOUT_S")
    media_allowed_domains: str = lever("", "Comma-separated domains media URLs may come from; empty: any.", "QV_MEDIA_ALLOWED_DOMAINS")
    media_allowed_networks: str = lever(
        "", "Comma-separated CIDR ranges media URLs may resolve to although they are loopback, link-local, private, "
        "CGNAT, multicast or unspecified (all denied by default, IPv4 and IPv6).", "QV_MEDIA_ALLOWED_NETWORKS")
    media_local_dir: str = lever("", "Directory file:// media may be read from; empty: no local files.", "QV_MEDIA_LOCAL_DIR")
    media_max_pixels: int = lever(
        1 << 28, "Most pixels of one request's images and video frames together, read from their headers before "
        "anything is decoded (one image may have at most 2^26).", "QV_MEDIA_MAX_PIXELS")
    media_decode_threads: int = lever(2, "Threads that decode and preprocess media, shared by all requests; more media "
                                      "waits its turn.", "QV_MEDIA_DECODE_THREADS")
    vision_max_patches_per_step: int = lever(
        16384, "Vision-encoder budget of one engine step, in patches before the 2x2 merge: prefill chunks stop "
        "before an image or video whose encoding does not fit (one larger than the budget is encoded alone).",
        "QV_VISION_MAX_PATCHES_PER_STEP")
    # -- Clef -----------------------------------------------------------------------------------
    clef: bool = lever(True, "Serve Clef decisions (POST /v1/systemone) when the checkpoint has a Clef head.", "QV_CLEF")
    clef_nmax: int = lever(34816, "Largest Clef record in tokens (images included).", "QV_CLEF_NMAX")
    clef_slots: int = lever(4, "Clef records in flight at once; others queue.", "QV_CLEF_SLOTS")
    clef_delta_host: bool = lever(False, "Keep Clef low-rank deltas in pinned host memory, streamed per layer.", "QV_CLEF_DELTA_HOST")

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: Any) -> "EngineConfig":
        """Levers from the environment, then keyword overrides (which win). Unknown keywords raise."""
        environ = os.environ if environ is None else environ
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise ConfigError(f"unknown engine option(s): {', '.join(unknown)}")
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            env = f.metadata.get("env")
            if env and env in environ and environ[env] != "":
                values[f.name] = _coerce(f, environ[env], env)
        for k, v in overrides.items():
            if v is not None:
                values[k] = _coerce(dataclasses.fields(cls)[_index(cls, k)], v, k)
        return cls(**values)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ConfigError(f"{f.name}={getattr(self, f.name)!r}: expected one of {', '.join(choices)}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "spec_k", "spec_max_seqs", "clef_slots",
                     "clef_nmax", "vision_max_patches_per_step", "max_long_partial_prefills", "max_prompts_per_request",
                     "max_stop_strings", "media_max_pixels", "media_decode_threads"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        for name in ("body_read_timeout_s", "shutdown_grace_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("max_model_len", "kv_cache_bytes", "long_prefill_token_threshold"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        for net in (n.strip() for n in self.media_allowed_networks.split(",")):
            try:
                ipaddress.ip_network(net or "0.0.0.0/32", strict=False)
            except ValueError:
                raise ConfigError(f"media_allowed_networks: {net!r} is not a CIDR range (e.g. 10.0.0.0/8, fd00::/8)") from None


def _index(cls, name: str) -> int:
    return [f.name for f in dataclasses.fields(cls)].index(name)


def _coerce(f: dataclasses.Field, value: Any, source: str) -> Any:
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    try:
        if kind.startswith("bool"):
            if isinstance(value, bool):
                return value
            s = str(value).strip().lower()
            if s in ("1", "true", "yes", "on"):
                return True
            if s in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if kind.startswith("int"):
            if isinstance(value, bool):
                raise ValueError(value)
            return int(value)
        if kind.startswith("float"):
            return float(value)
        return None if value is None else str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{source}={value!r}: expected {kind}") from None


def levers_markdown() -> str:
    """docs/LEVERS.md, generated from EngineConfig."""
    lines = [
        "# Levers",
        "",
        "Generated from `qv/config.py` by `python -m qv.config > docs/LEVERS.md`; do not edit by hand.",
        "Every lever is an environment variable and the same-named keyword of `LLM(...)` / `EngineConfig`",
        "(and a `qv serve` flag with dashes).",
        "",
        "| env | keyword | default | effect |",
        "| --- | --- | --- | --- |",
    ]
    for f in dataclasses.fields(EngineConfig):
        doc = f.metadata["doc"]
        if f.metadata.get("choices"):
            doc += f" Choices: {', '.join(f.metadata['choices'])}."
        default = "unset" if f.default is None else repr(f.default)
        lines.append(f"| `{f.metadata['env']}` | `{f.name}` | `{default}` | {doc} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(levers_markdown(), end="")
