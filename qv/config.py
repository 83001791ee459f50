"""Every engine lever, declared once in `EngineConfig` (a pydantic-settings model: env prefix `QV_`,
`Literal` choices, numeric bounds) with its default and meaning. Only this module reads os.environ:
`EngineConfig.from_env` reads the levers (and a levers file, `read_env_file`), `use_state_dir` points the
compiled-kernel caches at the state directory. `docs/LEVERS.md` is generated from the table
(`python -m qv.config > docs/LEVERS.md`; a test checks it is current) and so are `qv serve`'s flags.
Components take the scalars they need, never the whole config. The model's own config (config.json)
is parsed in qv/model_config.py; its names are re-exported here.
"""

from __future__ import annotations

import difflib
import io
import ipaddress
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from dotenv.parser import parse_stream
from pydantic import Field, ValidationError, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, EnvSettingsSource, SettingsConfigDict

from qv.errors import ConfigError
from qv.model_config import (SUPPORTED_ARCHITECTURES, SUPPORTED_MODEL_TYPES, ModelConfig, QuantConfig,  # noqa: F401
                             VisionConfig)

log = logging.getLogger("qv")

# --------------------------------------------------------------------------------------------
# Engine levers
# --------------------------------------------------------------------------------------------

ENV_PREFIX = "QV_"
BOOL_WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def lever(default: Any, doc: str, env: str | None = None, *, expect: str | None = None, **bounds: Any) -> Any:
    """One lever: its default, one-line meaning and bounds (pydantic's ge / gt / le / lt / pattern). Its
    environment variable is QV_ + the upper-cased name (`env`, if given, must say the same); choices are
    a `Literal[...]` annotation (the old positional choices tuple is refused); `expect` words what a
    `pattern` accepts, for error messages."""
    return Field(default, description=doc, json_schema_extra={"env": env, "expect": expect}, **bounds)


class EngineConfig(BaseSettings):
    """Every QV_* lever. `EngineConfig(**levers)` takes keywords only; `EngineConfig.from_env` reads the
    environment (and a levers file) too. Bad values raise ConfigError naming the lever and what it takes."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_ignore_empty=True, extra="forbid",
                                      allow_inf_nan=False, validate_assignment=True)

    # -- model and device ----------------------------------------------------------------------
    model: str | None = lever(None, "Checkpoint folder; unset serves the embedded tiny default model.")
    device: str = lever("auto", "auto: CUDA when present, else CPU; or cpu, cuda, cuda:N.",
                        pattern=r"^(auto|cpu|cuda(:\d+)?)$", expect="auto, cpu, cuda or cuda:N")
    tensor_parallel_size: int = lever(
        1, "Processes that each hold 1/N of every layer (vLLM's name): the engine starts N-1 workers, NCCL on CUDA "
        "(rank r on cuda:r), gloo on the CPU; the scheduler and sampling stay in the engine's process. N > 1 does not "
        "support CUDA graphs or images/videos yet.", ge=1)
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = lever(
        "auto", "Activation dtype. auto: float16 on sm_70, bfloat16 on sm_80+, float32 on CPU.")
    kernels: Literal["auto", "reference", "triton", "sm70"] = lever(
        "auto", "Op implementations: auto (sm70 on sm_70 GPUs, triton on newer ones, reference on CPU), reference, "
        "triton, sm70 (the Volta m8n8k4 raw-CUDA kernels where an op has them, Triton elsewhere).")
    ptxas: str = lever("", "ptxas that `qv kernels --arch` and `qv doctor` assemble sm_70 PTX with; empty: the one "
                       "Triton's wheel carries (CUDA 12.9).")
    seed: int = lever(0, "Seed for weight-free randomness (sampling without a per-request seed).")
    load_format: Literal["auto", "random"] = lever(
        "auto",
        "auto: read the checkpoint's safetensors; random: make weights on the device in the layout the checkpoint "
        "would load into (vLLM's dummy format, for benchmarks: a folder with only config.json serves).")
    quantization: Literal["auto", "gptq-int8", "gptq-int4", "awq", "fp8"] = lever(
        "auto",
        "auto: as the checkpoint's quantization_config says; with load_format random, the weights' format in "
        "place of the config's own: gptq-int8 GPTQ-Int8 (symmetric, group 128), gptq-int4 GPTQ-Int4 "
        "(symmetric, group 128), awq AWQ (4 bits with zero points, group 128), fp8 Qwen's block FP8 (e4m3, "
        "128x128 block scales; embeddings, lm_head and the GDN gates dense); the GDN gates in_proj_a/b stay "
        "dense at 4 bits.")
    w12: bool = lever(
        False,
        "Pack the attention q/k/v projections that load dense in bf16/fp16 (the checkpoint keeps them out of "
        "GPTQ/FP8) into 12-bit integers at load (1.5 bytes a weight, 0.75x bf16; representation error in "
        "docs/VALIDATION.md), cached on GPUs in state_dir/w12 by model, shape and tensor-parallel rank. fp32 runs "
        "and quantized projections are left as they are. Off: its decode GEMV measured 1.5x slower than bf16 "
        "projections at batch 1 on an H100 (docs/BENCHMARKS.md), so it saves memory, not time, until that kernel "
        "is replaced.")
    lm_head_int8: bool = lever(
        False, "Quantize a dense lm_head at load to int8 with one scale per vocabulary row (halves the 2.54 GB the "
        "27B reads every step; sampler logits and MTP drafts use it; logprobs carry the bound in VALIDATION.md).")
    # -- capacity ------------------------------------------------------------------------------
    max_model_len: int = lever(0, "Longest sequence (prompt + output); 0: the model's max_position_embeddings.", ge=0)
    max_num_seqs: int = lever(64, "Most sequences running in one step.", ge=1)
    max_num_batched_tokens: int = lever(2048, "Token budget of one step (prefill chunks + decodes).", ge=1)
    kv_cache_bytes: int = lever(0, "Bytes for attention KV blocks and GDN prefix snapshots; 0: derived from "
                                "gpu_memory_utilization (CPU: 256 MiB).", ge=0)
    gpu_memory_utilization: float = lever(0.90, "Share of GPU memory qv may plan for when kv_cache_bytes is 0.",
                                          gt=0, le=1)
    device_memory_bytes: int = lever(
        0, "Device memory the memory plan assumes, in bytes; 0: the device's own. Set, the plan is made for a GPU of "
        "this size (times gpu_memory_utilization) whatever runs it: `qv serve --dry-run` shows a deployment's plan "
        "from any machine (e.g. 34089730048, a 32 GB V100, with dtype float16), and on a larger GPU qv takes no "
        "more.", ge=0)
    block_size: int = lever(16, "Tokens per KV block.", ge=1)
    kv_dtype: Literal["auto", "fp16", "bf16", "int8"] = lever(
        "auto", "KV cache storage: auto (activation dtype), fp16, bf16, int8 (symmetric, fp32 scale per token and "
        "KV head).")
    gdn_state_dtype: Literal["fp32", "fp16", "int16"] = lever(
        "fp32", "Gated DeltaNet recurrent state storage: fp32, fp16, int16 (uniform grid with a scale per column).")
    max_gdn_slots: int = lever(0, "GDN state slots (one per running sequence); 0: max_num_seqs.", ge=0)
    cuda_graphs: bool = lever(True, "Replay captured CUDA graphs for decode steps; a graph that disagrees with the "
                              "eager forward at start-up stops the engine (0: decode runs eagerly).")
    warm_up: bool = lever(True, "On a GPU, run dummy requests at start-up so that Triton's first-launch compiles "
                          "(seconds each) stall no request; they leave no trace. 0: off.")
    piecewise_graph_max_rows: int = lever(
        0,
        "Steps with prompt rows (and decode steps no decode graph holds) of up to this many rows replay the forward's "
        "token-wise parts from CUDA graphs captured per row count, with attention and the GDN recurrence run eagerly "
        "between them (vLLM's piecewise CUDA graphs, max_cudagraph_capture_size; 512 is the intended setting); "
        "larger steps run eagerly. Needs cuda_graphs, one rank; pays with a step target (max_step_ms); checked "
        "against eager at start-up (passed: 512 rows, 64 layers, H100). 0 (default): off (docs/BENCHMARKS.md).", ge=0)
    async_scheduling: bool = lever(
        True,
        "Overlap the host work of a decode step with the GPU's: the next step is scheduled and launched before the "
        "last one's tokens reach the host (their ids go from the device into the next step's inputs; the row of a "
        "sequence that stopped is dropped). Tokens, text and finish reasons are the synchronous engine's, logprobs "
        "and Clef answers too up to fp32 rounding where the batches differ; with speculative decoding, images/videos, "
        "penalties, or a plan that could preempt, a step waits for the last one's tokens (0: every step waits).")
    long_prefill_token_threshold: int = lever(
        0,
        "A prefill with more prompt tokens left than this is long. While other sequences decode (or a short request "
        "waits), a long prefill "
        "(a Clef record or a long chat prompt) takes at most this many tokens of a step; alone it takes the whole "
        "budget (vLLM's name). 0: max_num_batched_tokens // 4.", ge=0)
    max_preemptions: int = lever(
        2, "Times a request may be preempted (by recompute) and readmitted as soon as its current length fits; "
        "preempted more often, it waits until its full length (prompt + max_tokens) fits beside the running "
        "sequences, then runs to the end, never preempted again (the blocks it still needs are reserved), so "
        "contexts that outgrow the KV cache cannot thrash it.", ge=0)
    scheduling_policy: Literal["fcfs", "priority"] = lever(
        "fcfs", "Order of the waiting queue (vLLM's --scheduling-policy): fcfs, first come first served; priority, a "
        "request's `priority` (lower first, arrival among equals), which also picks whom a preemption takes (the "
        "lowest priority, newest among equals). Under fcfs a `priority` other than 0 is a 400.")
    max_long_partial_prefills: int = lever(
        1, "Most long prefills that share one step with decoding sequences (vLLM's name).", ge=1)
    max_step_ms: float = lever(
        0.0,
        "Latency target of a step while sequences decode, in ms (the inter-token latency chats see beside prompts "
        "and Clef records; vLLM sizes the prefill chunk by a token count, this by time): each step's prompt tokens "
        "keep its predicted time under the target, predicted by a cost model fitted to the engine's own steps (a "
        "fixed part, jumps for prompt rows and past the linears' few-row edge, rows times a cost per kind). Every "
        "waiting prompt gets an equal share, at least 16 tokens (fewer, 1 at least, to stay within that edge), so "
        "records never starve, and with piecewise graphs the rows up to the step's padded size; with nothing decoding, "
        "prompts take max_num_batched_tokens. While on, it replaces long_prefill_token_threshold and "
        "max_long_partial_prefills in steps with decodes. 0 (the default): off; at the 64-layer 27B shapes on an H100 "
        "2.5x a decode step gave chats 2.6x their ITL but records 0.13x their rate alone (docs/BENCHMARKS.md). "
        "GPU-independent: max_step_decode_ratio.",
        ge=0)
    max_step_decode_ratio: float = lever(
        0.0, "The latency target of max_step_ms as a multiple of the predicted decode-only step of the same decoding "
        "rows (2.0: chats beside prompts see at most about twice their inter-token latency alone), so one value holds "
        "on any GPU and batch. 0: off. Setting both is refused; at or below 1 only the per-prompt floor is left.", ge=0)
    # -- sparse attention (long contexts; off: exact attention) ---------------------------------
    sparse_prefill: bool = lever(
        False, "Prompt chunks attend only to the key blocks that hold the target share of each query tile's softmax "
        "mass (sparse_mass): blocks ranked by their mean keys with a per-dimension Hoelder correction; sink, window and "
        "diagonal blocks always kept; prompts shorter than sparse_min_len keys stay dense. Keeps a mean and a spread "
        "table per KV page, refreshed at every KV write (counted in the memory plan). Triton chain only: refused with "
        "kernels=sm70.")
    sparse_mass: float = lever(0.85, "Share of a query tile's softmax mass sparse_prefill keeps; 1: every block "
                               "(exact).", gt=0, le=1)
    sparse_rule: Literal["certified", "estimate"] = lever(
        "certified", "Where sparse_prefill stops adding blocks: certified (a lower bound of the kept mass reaches "
        "sparse_mass, so the target holds whatever the keys, keeping more blocks) or estimate (the original's: the "
        "estimated mass reaches it).")
    sparse_min_len: int = lever(16384, "Keys below which a prompt chunk stays dense under sparse_prefill.", ge=0)
    sparse_decode: bool = lever(
        False, "Decode and speculative rows attend, per row and query head, to the best-scored sparse_decode_top "
        "share of the key blocks they see (at least sparse_decode_min_blocks, so short contexts stay dense), sink "
        "and recent blocks included; capturable in CUDA graphs. Shares sparse_prefill's tables; Triton chain only.")
    sparse_decode_top: float = lever(0.15, "Share of key blocks each decode row keeps under sparse_decode.", gt=0, le=1)
    sparse_decode_min_blocks: int = lever(256, "Fewest key blocks a decode row keeps under sparse_decode.", ge=1)
    sparse_block_tokens: int = lever(64, "Keys per selection block of sparse attention (a multiple of block_size).",
                                     ge=1)
    # -- prefix caching ------------------------------------------------------------------------
    prefix_caching: bool = lever(True, "Reuse KV blocks and GDN state snapshots of earlier prompts.")
    gdn_snapshot_interval: int = lever(
        0,
        "Tokens between GDN state snapshots for prefix reuse (a multiple of block_size; hits round down to it); "
        "0: the smallest multiple of 64 blocks at which snapshots cost at most half the KV bytes per token.", ge=0)
    prefix_cache_chat_reserve: float = lever(
        0.2, "Share of KV blocks whose cached chat prefixes Clef records may not evict (Clef rows hold at most the "
        "rest).", ge=0, lt=1)
    kv_offload_bytes: int = lever(0, "Pinned host memory for evicted KV blocks and snapshots; 0: off.", ge=0)
    # -- speculative decoding -------------------------------------------------------------------
    spec: Literal["off", "mtp", "ngram", "auto"] = lever("off", "Speculative decoding: off, mtp, ngram, auto.")
    spec_k: int = lever(3, "Draft tokens per step.", ge=1)
    spec_max_seqs: int = lever(16, "Most sequences verifying drafts in one step (each keeps k+1 GDN states).", ge=1)
    spec_draft_top1: bool = lever(
        True, "MTP drafts' argmax from the fused lm_head top-1 over an int4 ranking copy of the lm_head (0.64 GB at "
        "27B; re-scored exactly over a shortlist) instead of full logits, for up to 4 rows; GPU only.")
    spec_policy: Literal["backoff", "always", "off"] = lever(
        "backoff", "When a sequence drafts: backoff (a sequence whose drafts keep failing pauses drafting for 4 to 64 "
        "steps, then probes again), always (every decode step), off (never, and the MTP head does no work: the plain "
        "step benchmarks compare with).")
    # -- server ----------------------------------------------------------------------------------
    host: str = lever("127.0.0.1", "Listen address of `qv serve`.")
    port: int = lever(8000, "Listen port of `qv serve` (0: any free port).", ge=0, le=65535)
    served_model_name: str = lever("", "Comma-separated model names the API answers to; empty: the folder name.")
    api_key: str = lever("", "If set, the routes api_key_scope names require `Authorization: Bearer <key>` "
                         "(vLLM's --api-key).")
    api_key_scope: Literal["v1", "all"] = lever(
        "v1", "What api_key guards. v1 (vLLM's scope): /v1/*, /invocations, /reset_prefix_cache and /server_info; "
        "/health, /ping, /metrics, /version, /tokenize, /detokenize, /openapi.json and /docs stay open. all: every "
        "route but /health and /ping (and /metrics under metrics_public). Under both the playground's page (/, "
        "/playground) and its files (/static/*) stay open: they hold no data, and what they ask for carries the key.")
    root_path: str = lever(
        "", "The path prefix a reverse proxy serves qv under and strips before passing requests on (vLLM's "
        "--root-path, uvicorn's root_path), e.g. /qv: links the server builds and the API docs carry it; routes and "
        "the API key's scope match the path without it.")
    metrics_public: bool = lever(False, "With api_key_scope all, /metrics answers without the key too (for a "
                                 "scraper).")
    allowed_origins: str = lever(
        "*", "CORS: origins browsers may call from, comma-separated or a JSON list (vLLM's --allowed-origins); * any; "
        "empty: no CORS headers.", expect="a JSON list of strings, or comma-separated values")
    allowed_methods: str = lever("*", "CORS: methods a cross-origin request may use, comma-separated or a JSON list "
                                 "(vLLM's --allowed-methods); * any.",
                                 expect="a JSON list of strings, or comma-separated values")
    allowed_headers: str = lever("*", "CORS: request headers a cross-origin request may send, comma-separated or a "
                                 "JSON list (vLLM's --allowed-headers); * any.",
                                 expect="a JSON list of strings, or comma-separated values")
    allow_credentials: bool = lever(False, "CORS: let browsers send cookies and credentials cross-origin (vLLM's "
                                    "--allow-credentials).")
    trust_request_chat_template: bool = lever(
        False, "Render a request's own `chat_template` (transformers' Jinja sandbox, off the event loop) instead of "
        "refusing it with a 400 (vLLM's --trust-request-chat-template); trust the clients: a template may run long.")
    responses_store_bytes: int = lever(
        128 << 20, "Bytes of stored Responses API responses (`store`, the default while this is over 0) kept in memory "
        "for retrieve, cancel, delete and previous_response_id; past it the oldest finished ones are dropped. 0: "
        "nothing is stored (store=true is a 400).", ge=0)
    enable_thinking: bool = lever(False, "Default enable_thinking for the chat template (per-request override).")
    max_body_bytes: int = lever(32 << 20, "Largest request body; larger gets 413.", ge=1)
    max_waiting: int = lever(1024, "Most sequences waiting (prompts x n, counted at admission); a request that "
                             "would pass it gets 503 with Retry-After.", ge=0)
    max_prompts_per_request: int = lever(256, "Most prompts in one /v1/completions request.", ge=1)
    max_stop_strings: int = lever(64, "Most stop strings in one request.", ge=1)
    body_read_timeout_s: float = lever(30.0, "Longest wait for a request body to arrive whole; slower gets 408.", gt=0)
    shutdown_grace_s: float = lever(10.0, "On SIGTERM: new requests get 503 while generations in flight may finish "
                                    "for this long; then streams get a final error event and [DONE] and the process "
                                    "exits.", gt=0)
    state_dir: str = lever("", "Directory for compiled kernels (Triton, CuPy), the embedded tiny model and "
                           "anything else reused by the next start; empty: ~/.cache/qv.")
    max_logprobs: int = lever(20, "Most top logprobs a request may ask for.", ge=0)
    header_read_timeout_s: float = lever(
        10.0, "Longest wait for a request's headers once a connection opens or finishes a response; a connection "
        "that sends none in time is closed.", gt=0)
    keep_alive_timeout_s: float = lever(5.0, "Idle time after which a keep-alive connection is closed (uvicorn's "
                                        "timeout_keep_alive).", gt=0)
    max_connections: int = lever(
        512, "Most open connections; a request past it gets 503 (uvicorn's limit_concurrency) and a connection "
        "opened past twice it is answered 503 and closed at once. Keep it under the process's file limit.", ge=1)
    stream_stall_timeout_s: float = lever(
        30.0, "A streaming client that reads nothing for this long is cut (its engine request aborted, its rows "
        "freed); meanwhile nothing more is sent to it and its outputs wait merged into one (vLLM's way: memory "
        "bounded by its max_tokens), while the engine goes on generating it.", gt=0)
    # -- structured outputs ------------------------------------------------------------------------
    grammar_compile_workers: int = lever(
        2, "Processes that compile structured-output grammars (xgrammar), apart from the threads that render chats; "
        "a compile over its budget or whose client left is killed with its process.", ge=1)
    grammar_compile_timeout_s: float = lever(
        10.0, "Budget of one request's grammar compile: a compile that takes longer gets a 400 (and the same "
        "constraint again is refused at once); a request that waits this long for a free worker gets 503.", gt=0)
    grammar_max_spec_bytes: int = lever(256 << 10, "Largest structured-output constraint (JSON schema, regex, "
                                        "grammar, choice list or the tools' schemas) in bytes.", ge=1)
    grammar_max_properties: int = lever(512, "Most object properties in one JSON schema (all objects together).",
                                        ge=1)
    grammar_max_enum_entries: int = lever(4096, "Most enum entries in one JSON schema (all enums together), or "
                                          "guided_choice options.", ge=1)
    grammar_max_depth: int = lever(32, "Deepest nesting of a JSON schema's objects and arrays.", ge=1)
    grammar_max_any_of: int = lever(64, "Most anyOf/oneOf/allOf branches in one JSON schema (all together).", ge=1)
    grammar_max_regex_chars: int = lever(4096, "Longest regex: a regex constraint, or one pattern in a JSON schema.",
                                         ge=1)
    grammar_mask_budget_ms: float = lever(
        50.0, "Most host time one call of a constrained sequence's grammar may take in an engine step (its token "
        "mask, or accepting a token); a grammar that takes more is stopped with an error, so the batch is not slowed.",
        gt=0)
    log_level: Literal["debug", "info", "warning", "error", "critical"] = lever(
        "info", "Log level of `qv serve` (qv's loggers and uvicorn's, in one format).")
    log_stats: bool = lever(True, "Log a stats line every log_stats_interval_s while the engine has work: prompt and "
                            "generation tok/s, running / waiting sequences, preemptions, KV usage, prefix-cache hit "
                            "rate, draft acceptance with speculation (0: none).")
    log_stats_interval_s: float = lever(10.0, "Seconds between stats lines (log_stats).", gt=0)
    access_log: Literal["api", "all", "off"] = lever(
        "api", "Access lines of `qv serve`: api (every route but the /health and /metrics probes), all, off.")
    # -- media -----------------------------------------------------------------------------------
    media_max_images: int = lever(20, "Most images per chat request (0 with media_max_videos 0: the vision tower "
                                  "is not loaded).", ge=0)
    media_max_videos: int = lever(2, "Most videos per chat request.", ge=0)
    media_max_video_frames: int = lever(
        4096, "Most frames of one video (MP4/WebM: declared by its header, or its duration times its frame rate, "
        "then counted; animated images: counted), refused before decoding.", ge=1)
    media_video_decode_timeout_s: float = lever(
        60.0, "Longest decoding of one MP4/WebM video (checked between frames); past it the request gets a 400.", gt=0)
    media_max_bytes: int = lever(20 << 20, "Largest fetched media file.", ge=1)
    media_timeout_s: float = lever(10.0, "Timeout for fetching one media URL.", gt=0)
    media_allowed_domains: str = lever("", "Comma-separated domains media URLs may come from; empty: any.")
    media_allowed_networks: str = lever(
        "", "Comma-separated CIDR ranges media URLs may resolve to although they are loopback, link-local, private, "
        "CGNAT, multicast or unspecified (all denied by default, IPv4 and IPv6).",
        expect="comma-separated CIDR ranges (e.g. 10.0.0.0/8, fd00::/8)")
    media_local_dir: str = lever("", "Directory file:// media may be read from; empty: no local files.")
    media_max_pixels: int = lever(
        1 << 28, "Most pixels of one request's images and video frames together, read from their headers before "
        "anything is decoded (one image or frame may have at most 2^26): every frame of an animated image, the "
        "frames the processor samples of an MP4/WebM video.", ge=1)
    media_decode_threads: int = lever(2, "Threads that decode and preprocess media, shared by all requests; more "
                                      "media waits its turn.", ge=1)
    vision_max_patches_per_step: int = lever(
        16384, "Vision-encoder budget of one engine step, in patches before the 2x2 merge: prefill chunks stop "
        "before an image or video whose encoding does not fit (one larger than the budget is encoded alone).", ge=1)
    # -- Clef -----------------------------------------------------------------------------------
    clef: bool = lever(True, "Serve Clef decisions (POST /v1/systemone) when the checkpoint has a Clef head.")
    clef_nmax: int = lever(34816, "Largest Clef record in tokens (images included).", ge=1)
    clef_max_body_bytes: int = lever(
        16 << 20, "Largest /v1/systemone body in bytes (JSON or multipart, images included; zstd-decoded), under "
        "max_body_bytes: a larger one gets 413 as it arrives, its rest discarded unkept, before anything is parsed or "
        "tokenized (a record's text holds at most clef_nmax tokens).", ge=1)
    clef_slots: int = lever(4, "Clef records in flight at once; others queue.", ge=1)
    clef_delta_host: bool = lever(False, "Keep Clef low-rank deltas in pinned host memory, streamed per layer.")
    # -- LoRA adapters (vLLM's names) -------------------------------------------------------------
    enable_lora: bool = lever(False, "Serve PEFT LoRA adapters beside the base model; a request's `model` names one.")
    lora_modules: str = lever(
        "", "Adapters to serve from the start: name=path entries (space- or comma-separated), or a JSON list of "
        "them or of {\"name\", \"path\"} objects (vLLM's --lora-modules, repeatable on the command line).")
    max_loras: int = lever(1, "Adapters in device memory at once (slots reserved in the memory plan); a step runs "
                           "rows of at most this many, the others wait their turn.", ge=1)
    max_lora_rank: int = lever(16, "Largest adapter rank; every slot reserves this rank on every projection.", ge=1)
    max_cpu_loras: int = lever(0, "Adapters held in host memory (paged into the device slots as steps need them); "
                               "0: no bound.", ge=0)
    allow_runtime_lora_updating: bool = lever(
        False, "Open /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING).")

    def __init__(self, **levers: Any):
        origins = levers.pop("_origins", None)  # from resolve: where each value came from, for the message
        unknown = sorted(set(levers) - set(type(self).model_fields))
        if unknown:
            raise ConfigError(f"unknown engine option(s): {', '.join(unknown)}")
        try:
            super().__init__(**levers)
        except ValidationError as e:
            raise ConfigError(explain(e, levers, origins)) from None
        explicit_ratio = "max_step_decode_ratio" in self.model_fields_set  # a default ratio yields to max_step_ms
        if self.max_step_ms > 0 and self.max_step_decode_ratio > 0 and explicit_ratio:
            raise ConfigError("max_step_ms and max_step_decode_ratio are one latency target in two forms "
                              f"(got {self.max_step_ms} and {self.max_step_decode_ratio}): set at most one")

    def __setattr__(self, name: str, value: Any) -> None:
        try:
            super().__setattr__(name, value)
        except ValidationError as e:
            raise ConfigError(explain(e, {name: value})) from None

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        return (init_settings,)  # the environment is read by from_env only, so EngineConfig() is the defaults

    @field_validator("*", mode="before")
    @classmethod
    def _parse(cls, value: Any, info: ValidationInfo) -> Any:
        kind = cls.model_fields[info.field_name].annotation
        if isinstance(value, os.PathLike):
            return os.fspath(value)
        if kind is bool and not isinstance(value, bool):
            word = BOOL_WORDS.get(str(value).strip().lower())
            if word is None:
                raise ValueError("not a boolean")
            return word
        if kind in (int, float) and isinstance(value, bool):
            raise ValueError("a boolean is not a number")
        return value

    @field_validator("allowed_origins", "allowed_methods", "allowed_headers")
    @classmethod
    def _cors_list(cls, value: str) -> str:
        string_list(value)  # a ValueError names the lever
        return value

    @field_validator("media_allowed_networks")
    @classmethod
    def _networks(cls, value: str) -> str:
        for net in (n.strip() for n in value.split(",")):
            ipaddress.ip_network(net or "0.0.0.0/32", strict=False)  # a ValueError names the lever
        return value

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, env_file: str | os.PathLike | None = None,
                 **overrides: Any) -> "EngineConfig":
        """Levers from the environment (os.environ unless given), then a levers file, then keyword overrides
        (None ones are ignored): later wins. Unknown keywords and bad values raise ConfigError."""
        return cls.resolve(environ, env_file, **overrides)[0]

    @classmethod
    def resolve(cls, environ: Mapping[str, str] | None = None, env_file: str | os.PathLike | None = None,
                **overrides: Any) -> tuple["EngineConfig", dict[str, str]]:
        """from_env, plus where each lever that was set came from ("QV_X in the environment", "QV_X in
        FILE:LINE", "argument")."""
        unknown = sorted(set(overrides) - set(cls.model_fields))
        if unknown:
            raise ConfigError(f"unknown engine option(s): {', '.join(unknown)}")
        environ = os.environ if environ is None else environ
        known = {env_name(n) for n in cls.model_fields}
        for key in sorted(k for k in environ if k.upper().startswith(ENV_PREFIX) and k.upper() not in known):
            log.warning("%s in the environment is no qv lever and is ignored (see docs/LEVERS.md)", key)
        values = _EnvSource(cls, environ)()
        origins = {name: f"{env_name(name)} in the environment" for name in values}
        if env_file is not None:
            lines = read_env_file(env_file)
            for name, value in _EnvSource(cls, {k: v for k, (v, _) in lines.items()})().items():
                key = env_name(name)
                loc = f"{env_file}:{lines[key][1]}"
                if name in values and values[name] != value:
                    log.warning("%s=%s in the environment is overridden by %s=%s in %s", key, values[name], key, value,
                                loc)
                values[name], origins[name] = value, f"{key} in {loc}"
        for name, value in overrides.items():
            if value is not None:
                values[name], origins[name] = value, "argument"
        return cls(**values, _origins=origins), origins

    def replace(self, **changes: Any) -> "EngineConfig":
        """A copy with `changes` applied and checked (dataclasses.replace for levers)."""
        return type(self)(**{**self.model_dump(), **changes})


class _EnvSource(EnvSettingsSource):
    """pydantic-settings' environment source over a given mapping (os.environ, or a levers file's keys)."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]):
        self._environ = environ
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:  # the hook pydantic-settings' dotenv source overrides too
        return {k.lower(): v for k, v in self._environ.items() if v != ""}  # case-insensitive; empty means unset


def string_list(value: str) -> list[str]:
    """A list lever's items: a JSON list of strings (vLLM's flag form) or comma-separated values."""
    if value.strip().startswith("["):
        items = json.loads(value)
        if not all(isinstance(x, str) for x in items):
            raise ValueError("a JSON list of strings")
        return items
    return [x.strip() for x in value.split(",") if x.strip()]


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def expected(name: str) -> str:
    """What lever `name` takes, in words (for errors, LEVERS.md and --help)."""
    info = EngineConfig.model_fields[name]
    kind = info.annotation
    if get_origin(kind) is Literal:
        return "one of " + ", ".join(get_args(kind))
    if kind is bool:
        return "a boolean (1/0, true/false, yes/no, on/off)"
    extra = info.json_schema_extra or {}
    if extra.get("expect"):
        return extra["expect"]
    words = {int: "an integer", float: "a number"}.get(kind, "a string")
    return " ".join([words, bounds(name).replace(", ", " and ")]).strip()


def bounds(name: str) -> str:
    """The lever's numeric bounds, as ">= 1, <= 65535"; empty without any."""
    out = []
    for m in EngineConfig.model_fields[name].metadata:
        for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if getattr(m, attr, None) is not None:
                out.append(f"{sign} {getattr(m, attr)}")
    return ", ".join(out)


def explain(error: ValidationError, values: Mapping[str, Any], origins: Mapping[str, str] | None = None) -> str:
    """One line per bad lever: its name, the value, where it came from and what it takes."""
    parts = []
    for err in error.errors():
        name = str(err["loc"][0]) if err["loc"] else "?"
        if name not in EngineConfig.model_fields:
            parts.append(err["msg"])
            continue
        where = (origins or {}).get(name, "argument")
        source = "" if where == "argument" else f" (from {where})"
        parts.append(f"{name}={values.get(name, err.get('input'))!r}{source}: expected {expected(name)}")
    return "; ".join(parts)


def _check_env_names() -> None:
    for name, info in EngineConfig.model_fields.items():
        env = (info.json_schema_extra or {}).get("env")
        if env is not None and env != env_name(name):
            raise TypeError(f"lever {name}: its environment variable is {env_name(name)}, not {env}")


_check_env_names()


# --------------------------------------------------------------------------------------------
# Levers files and the state directory
# --------------------------------------------------------------------------------------------


def read_env_file(path: str | os.PathLike) -> dict[str, tuple[str, int]]:
    """A levers file in the original stack's format: `KEY=value` lines, `#` comments, blank lines,
    optional quotes and `export ` prefixes (python-dotenv's grammar, no interpolation). Every key must be a
    QV_* lever and appear once; anything else is a ConfigError naming the file, line and key.
    Returns env name -> (value, line)."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"levers file {path}: {e.strerror or e}") from None
    known = {env_name(n) for n in EngineConfig.model_fields}
    out: dict[str, tuple[str, int]] = {}
    for b in parse_stream(io.StringIO(text)):
        raw = b.original.string
        line = b.original.line + len(raw) - len(raw.lstrip("\n"))
        shown = raw.strip()
        if b.error or (b.key is not None and b.value is None):
            raise ConfigError(f"{path}:{line}: cannot read {shown!r}: expected KEY=value")
        if b.key is None:
            continue
        if b.key not in known:
            close = difflib.get_close_matches(b.key.upper(), sorted(known), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            what = "no qv lever" if b.key.startswith(ENV_PREFIX) else "not a QV_* lever (a levers file holds levers only)"
            raise ConfigError(f"{path}:{line}: {b.key} is {what}{hint}; see docs/LEVERS.md")
        if b.key in out:
            raise ConfigError(f"{path}:{line}: {b.key} is set twice (first on line {out[b.key][1]})")
        out[b.key] = (b.value, line)
    return out


# compiled-kernel caches of the libraries qv compiles through, and their folder under the state dir
KERNEL_CACHES = {"TRITON_CACHE_DIR": "triton", "CUPY_CACHE_DIR": "cupy"}
_SET_HERE: dict[str, str] = {}  # the cache variables this process set (re-pointed by a later state dir)


def state_path(state_dir: str = "") -> Path:
    """The state directory a `state_dir` lever value names (empty: ~/.cache/qv)."""
    return Path(state_dir).expanduser() if state_dir else Path.home() / ".cache" / "qv"


def use_state_dir(state_dir: str = "") -> dict[str, str]:
    """Point Triton's and CuPy's compiled-kernel caches under the state directory, before either compiles
    anything (both read their variable at each compile). A variable the operator set stays as it is.
    Returns variable -> folder in effect."""
    root = state_path(state_dir)
    root.mkdir(parents=True, exist_ok=True)
    for var, sub in KERNEL_CACHES.items():
        if var not in os.environ or os.environ[var] == _SET_HERE.get(var):
            os.environ[var] = _SET_HERE[var] = str(root / sub)
    return {var: os.environ[var] for var in KERNEL_CACHES}


def kernel_cache_dirs(state_dir: str = "") -> dict[str, str]:
    """What use_state_dir would give, without setting anything (for --dry-run and doctor)."""
    root = state_path(state_dir)
    return {var: os.environ[var] if var in os.environ and os.environ[var] != _SET_HERE.get(var) else str(root / sub)
            for var, sub in KERNEL_CACHES.items()}


def levers_markdown() -> str:
    """docs/LEVERS.md, generated from EngineConfig."""
    lines = [
        "# Levers",
        "",
        "Generated from `qv/config.py` by `python -m qv.config > docs/LEVERS.md`; do not edit by hand.",
        "Every lever is an environment variable, a line of a levers file (`qv serve --env-file FILE`), the",
        "same-named keyword of `LLM(...)` / `EngineConfig` and a `qv serve` flag with dashes.",
        "",
        "| env | keyword | default | effect |",
        "| --- | --- | --- | --- |",
    ]
    for name, info in EngineConfig.model_fields.items():
        doc = info.description
        if get_origin(info.annotation) is Literal:
            doc += f" Choices: {', '.join(get_args(info.annotation))}."
        elif bounds(name):
            doc += f" Range: {bounds(name)}."
        default = "unset" if info.default is None else repr(info.default)
        lines.append(f"| `{env_name(name)}` | `{name}` | `{default}` | {doc} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(levers_markdown(), end="")
