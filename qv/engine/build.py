"""Start-up: resolve the model folder, device and dtypes from the levers, load the model and
tokenizer, and plan memory (KV blocks and GDN slots) once, from a budget."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from qv import kernels
from qv.config import ConfigError, EngineConfig, ModelConfig, state_path, use_state_dir
from qv.model_config import read_json_object
from qv.engine.clef_rows import clef_reserve_bytes
from qv.engine.lora_rows import check_lora_levers, reserve_lora_slots
from qv.engine.memory_plan import MemoryPlan
from qv.engine.prefix_cache import PrefixPlan, plan_prefix_cache
from qv.engine.tensor_parallel import TPDriver, check_levers, rank_device
from qv.kernels.paged_attention.sparse import SparsePolicy
from qv.model.cache import (KV_DTYPES, STATE_DTYPES, HybridCache, allocate_cache, gdn_bytes_per_slot,
                            kv_bytes_per_block, prefill_workspace_bytes, warm_prefill_attention)
from qv.model.parallel import TPGroup
from qv.model.lm_head_int8 import lm_head_int8
from qv.model.qwen3_5 import Qwen3_5TextModel, held_bytes, load_text_model, read_output_embedding
from qv.model.random_weights import checkpoint_reader, with_quantization
from qv.model.vision_processor import missing_processor_config
from qv.version import __version__

log = logging.getLogger("qv")

CPU_KV_BYTES = 256 << 20
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
ACTIVATION_RESERVE = 0.10  # share of the planned GPU budget left for activations and graphs


@dataclass
class EngineParts:
    model_dir: Path
    model_config: ModelConfig
    model: Qwen3_5TextModel
    tokenizer: object
    cache: HybridCache
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    generation_defaults: dict
    mtp_head: object | None  # qv.spec.mtp.MTPHead when speculation drafts with it
    prefix_plan: PrefixPlan = PrefixPlan()  # snapshot pool, chat reserve and host tier sizes
    vision: object | None = None  # qv.model.vision.VisionTower when the checkpoint has one (and media is on)
    clef: object | None = None  # qv.clef.adapters.ClefAssets when the folder has a Clef head and clef is on
    memory_plan: MemoryPlan | None = None
    media_off: str | None = None  # why images and videos are off (None: on)
    tp: TPDriver | None = None  # the tensor-parallel workers (tensor_parallel_size > 1)


def default_model_dir(state_dir: str = "") -> Path:
    """The embedded tiny model (with a tiny Clef head), built deterministically on first use into the
    state directory and reused after."""
    from qv.model.tiny import EMBEDDED_BUILD, make_embedded

    path = state_path(state_dir) / f"tiny-{__version__}-{EMBEDDED_BUILD}"
    if not (path / "config.json").is_file():
        log.warning("building the embedded tiny default model in %s (first start only)", path)
        tmp = path.with_name(path.name + ".partial")
        make_embedded(tmp)
        tmp.rename(path)
    return path


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={name!r} but no CUDA device is available")
    return dev


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if device.type != "cuda":
        return torch.float32
    major, _ = torch.cuda.get_device_capability(device)
    return torch.float16 if major < 8 else torch.bfloat16


def resolve_kv_dtype(name: str, act: torch.dtype) -> torch.dtype:
    return act if name == "auto" else KV_DTYPES[name]


def read_generation_config(model_dir: Path) -> dict:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return {}
    return read_json_object(path)


def load_tokenizer(model_dir: Path, state_dir: str = ""):
    """The folder's tokenizer; a folder without one (a config.json for random weights) gets the embedded
    tiny tokenizer, which is enough to take token ids and to decode the ids it knows."""
    from transformers import AutoTokenizer

    if not any((model_dir / f).is_file() for f in TOKENIZER_FILES):
        log.warning("%s has no tokenizer files: using the embedded tiny tokenizer (ids past its vocabulary "
                    "decode to nothing)", model_dir)
        model_dir = default_model_dir(state_dir)
    return AutoTokenizer.from_pretrained(str(model_dir))


def resolve_model_dir(cfg: EngineConfig) -> Path:
    model_dir = Path(cfg.model) if cfg.model else default_model_dir(cfg.state_dir)
    if not model_dir.is_dir():
        raise ConfigError(f"model folder {model_dir} does not exist" + _hub_id_hint(str(model_dir)))
    return model_dir


def _hub_id_hint(name: str) -> str:
    """What to do when a missing folder is spelt like a Hugging Face Hub id (org/name), as vLLM takes it."""
    parts = name.split("/")
    if len(parts) != 2 or not all(parts) or name.startswith((".", "~")):
        return ""
    return (f": qv does not download from the Hugging Face Hub; fetch it first (`hf download {name} --local-dir "
            f"/models/{parts[1]}`) and pass that folder (`qv serve /models/{parts[1]}`)")


def media_off_reason(cfg: EngineConfig, mcfg: ModelConfig, model_dir: Path) -> str | None:
    """Why images and videos are off, in words for the 400 a request with media gets; None when
    the vision tower loads (the config has one, media is on, the folder has the processor config)."""
    if mcfg.vision is None:
        return "it has no vision tower (its config.json has no vision_config)"
    if not (cfg.media_max_images or cfg.media_max_videos):
        return "media_max_images and media_max_videos are 0"
    return missing_processor_config(model_dir)


def wants_media(cfg: EngineConfig, mcfg: ModelConfig, model_dir: Path) -> bool:
    """Whether the vision tower loads; a vision checkpoint without its processor config serves text."""
    reason = media_off_reason(cfg, mcfg, model_dir)
    if reason is not None and mcfg.vision is not None and (cfg.media_max_images or cfg.media_max_videos):
        log.warning("%s has a vision_config, but %s: it serves text, and requests with images or videos get a 400",
                    model_dir, reason)
    return reason is None


def resolve_max_len(cfg: EngineConfig, mcfg: ModelConfig) -> int:
    max_len = cfg.max_model_len or mcfg.max_position_embeddings
    if max_len > mcfg.max_position_embeddings:
        raise ConfigError(f"max_model_len={max_len} exceeds the model's max_position_embeddings "
                          f"{mcfg.max_position_embeddings}")
    return max_len


def wants_mtp(cfg: EngineConfig, mcfg: ModelConfig) -> bool:
    return cfg.spec == "mtp" or (cfg.spec == "auto" and mcfg.mtp_num_hidden_layers > 0)


def build_engine_parts(cfg: EngineConfig) -> EngineParts:
    use_state_dir(cfg.state_dir)  # before Triton or CuPy compiles anything
    device = resolve_device(cfg.device)
    check_lora_levers(cfg)
    sparse_policy(cfg, device)  # a sparse lever the kernel chain cannot run stops the start before loading
    tp = start_tensor_parallel(cfg, device) if cfg.tensor_parallel_size > 1 else None
    try:
        return _build(cfg, rank_device(device, 0) if tp else device, tp)
    except BaseException:
        if tp is not None:  # the workers wait for a cache plan that will not come
            tp.shutdown()
        raise


def start_tensor_parallel(cfg: EngineConfig, device: torch.device) -> TPDriver:
    """The workers of tensor_parallel_size > 1, once the levers are known to be supported there."""
    model_dir = resolve_model_dir(cfg)
    mcfg = ModelConfig.from_dir(model_dir)
    check_levers(cfg, media_off_reason(cfg, mcfg, model_dir) is None, device)
    return TPDriver(cfg, rank_device(device, 0), load_rank)


def _checkpoint(cfg: EngineConfig, device: torch.device):
    """(folder, activation dtype, model config, weight reader) as the levers say (every rank alike)."""
    model_dir = resolve_model_dir(cfg)
    dtype = resolve_dtype(cfg.dtype, device)
    kernels.set_backend(cfg.kernels)
    mcfg = with_quantization(ModelConfig.from_dir(model_dir), cfg.quantization, cfg.load_format)
    return model_dir, dtype, mcfg, checkpoint_reader(model_dir, mcfg, cfg.load_format, cfg.seed, device)


def load_rank(cfg: EngineConfig, device: torch.device, tp: TPGroup):
    """A tensor-parallel worker's shard (the driver's levers), how to allocate its cache from the
    driver's plan: make_cache(num_blocks, num_slots), and its speculator over that cache: make_spec(cache)
    (None with spec=off; with an MTP head, the head's shard and its KV layer in the cache)."""
    from qv.spec.speculator import Speculator

    use_state_dir(cfg.state_dir)
    model_dir, dtype, mcfg, reader = _checkpoint(cfg, device)
    model = load_text_model(str(model_dir), mcfg, dtype=dtype, device=device, reader=reader, tp=tp)
    if cfg.lm_head_int8:
        lm_head_int8(model.lm_head)
    head = None
    if wants_mtp(cfg, mcfg):
        from qv.spec.mtp import load_mtp_head

        head = load_mtp_head(str(model_dir), mcfg, model, dtype, device, reader=reader,
                             draft_top1=cfg.spec_draft_top1, tp=tp)
    pack_w12_projections(cfg, model, head, model_dir, device, tp.rank, tp.world_size)
    mtp_layers = (mcfg.num_hidden_layers,) if head else ()
    if cfg.clef:  # the rank's cut of Clef's deltas; the head and its state live on the driver only
        from qv.clef.adapters import clef_layout, load_clef_deltas

        if clef_layout(model_dir) == "adapters":
            load_clef_deltas(model_dir, model, delta_host=cfg.clef_delta_host)
    if cfg.enable_lora:  # the adapters' device slots, as the driver's (each write comes with a step)
        reserve_lora_slots(model, cfg.max_loras, cfg.max_lora_rank)

    def make_cache(num_blocks: int, num_slots: int) -> HybridCache:
        return allocate_cache(model.cfg, num_blocks, cfg.block_size, num_slots, resolve_kv_dtype(cfg.kv_dtype, dtype),
                              STATE_DTYPES[cfg.gdn_state_dtype], dtype, device, extra_attention_layers=mtp_layers,
                              sparse=sparse_policy(cfg, device))

    def make_spec(cache: HybridCache) -> Speculator | None:
        return Speculator.for_engine(cfg, head, model.cfg, cache, device) if cfg.spec != "off" else None

    return model, make_cache, make_spec


def _build(cfg: EngineConfig, device: torch.device, tp: TPDriver | None) -> EngineParts:
    model_dir, dtype, mcfg, reader = _checkpoint(cfg, device)
    log.info("loading %s on %s (%s, kernels=%s%s%s)", model_dir, device, dtype, cfg.kernels,
             ", random weights" if cfg.load_format == "random" else "",
             f", rank 0 of {tp.world}" if tp else "")
    vision, media_off = None, media_off_reason(cfg, mcfg, model_dir)
    if wants_media(cfg, mcfg, model_dir):
        from qv.model.vision import load_multimodal_model

        model, vision = load_multimodal_model(str(model_dir), mcfg, dtype=dtype, device=device, reader=reader)
    else:
        model = load_text_model(str(model_dir), mcfg, dtype=dtype, device=device, reader=reader,
                                tp=tp.group if tp else None)
    if cfg.lm_head_int8:  # before the MTP head: its fused top-1 ranks the int8 rows
        lm_head_int8(model.lm_head)
    tokenizer = load_tokenizer(model_dir, cfg.state_dir)
    gen = read_generation_config(model_dir)
    eos = gen.get("eos_token_id", list(mcfg.eos_token_ids))
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else mcfg.eos_token_ids)
    max_len = resolve_max_len(cfg, mcfg)
    mtp_head = None
    if wants_mtp(cfg, mcfg):
        from qv.spec.mtp import load_mtp_head

        mtp_head = load_mtp_head(str(model_dir), mcfg, model, dtype, device, reader=reader,
                                 draft_top1=cfg.spec_draft_top1, tp=tp.group if tp else None)
    pack_w12_projections(cfg, model, mtp_head, model_dir, device, 0, tp.world if tp else 1)
    clef = None
    if cfg.clef:  # Clef's head and low-rank deltas, before the memory plan (qv/clef/adapters.py)
        from qv.clef.adapters import load_clef

        clef = load_clef(model_dir, model, delta_host=cfg.clef_delta_host)
    if cfg.enable_lora:  # the adapters' device slots, after Clef's slot 0 and before the plan that counts them
        log.info("LoRA: %d device slots of rank %d: %.1f MiB", cfg.max_loras, cfg.max_lora_rank,
                 reserve_lora_slots(model, cfg.max_loras, cfg.max_lora_rank) / 2**20)
    # a rank's view (its heads) sizes the cache; the workers allocate the same blocks and slots
    cache, prefix, plan = plan_cache(cfg, model.cfg if tp else mcfg, device, dtype, max_len,
                                     mtp_layers=(mcfg.num_hidden_layers,) if mtp_head else (),
                                     reserve_bytes=clef_reserve_bytes(clef, cfg.clef_slots, min(cfg.clef_nmax, max_len)),
                                     weight_bytes=held_bytes(model, mtp_head, vision, clef))
    log.info("%s", plan.summary())
    if device.type == "cuda":
        t0 = time.perf_counter()
        planned = warm_prefill_attention(model.cfg if tp else mcfg, cfg.max_num_batched_tokens, device, dtype,
                                         resolve_kv_dtype(cfg.kv_dtype, dtype))
        if planned:
            log.info("prompt attention: %d cuDNN plans built in %.1f s", planned, time.perf_counter() - t0)
    if clef is not None and tp is not None:  # host memory, off the device plan: rank 0's lm_head is a vocabulary slice
        clef.output_embedding = host_copy(read_output_embedding(mcfg, reader, dtype, device))
    if tp is not None:
        tp.send_plan(cache.num_blocks, cache.num_slots, prefix)
    if prefix.enabled:
        log.info("prefix cache: %d GDN snapshots every %d tokens, %d blocks reserved for chat; host tier %d blocks, "
                 "%d snapshots", prefix.num_snapshots, prefix.interval, prefix.reserve_blocks, prefix.host_blocks,
                 prefix.host_snapshots)
    defaults = {k: gen[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                                    "presence_penalty", "frequency_penalty") if k in gen}
    return EngineParts(model_dir, mcfg, model, tokenizer, cache, max_len, eos_ids, defaults, mtp_head, prefix, vision,
                       clef=clef, memory_plan=plan, media_off=media_off, tp=tp)


def pack_w12_projections(cfg: EngineConfig, model, mtp_head, model_dir: Path, device: torch.device, rank: int,
                         world: int) -> None:
    """The w12 lever: the attention q/k/v projections (the MTP head's too) loaded dense in bf16/fp16 packed to
    12 bits (qv/model/w12.py), the packs cached in the state directory on GPUs."""
    if not cfg.w12:
        return
    from qv.model.w12 import PackCache, apply_w12, model_key

    root = state_path(cfg.state_dir) if device.type == "cuda" else None
    cache = PackCache(root, model_key(model_dir, cfg.load_format, cfg.seed), rank, world)
    packed = apply_w12(list(model.layers) + ([mtp_head.layer] if mtp_head is not None else []), cache)
    if packed:
        log.info("W12: %d attention projection weights packed to 12 bits (%d from the cache, %d stale packs "
                 "rejected)", packed, cache.hits, cache.rejected)


def host_copy(w):
    """A dense tensor or GPTQWeight in host memory (read where the model lives: random weights are made there)."""
    if isinstance(w, torch.Tensor):
        return w.cpu()
    return dataclasses.replace(w, **{f: None if getattr(w, f) is None else getattr(w, f).cpu()
                                     for f in ("qweight", "scales", "zeros", "g_idx")})


def sparse_policy(cfg: EngineConfig, device: torch.device) -> SparsePolicy | None:
    """The sparse attention levers as the attention layers use them; None when both are off. ConfigError
    naming the lever where the kernel chain has no sparse kernel (sm70) or the blocks do not tile the pages."""
    if not (cfg.sparse_prefill or cfg.sparse_decode):
        return None
    on = "sparse_prefill" if cfg.sparse_prefill else "sparse_decode"
    volta = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 7
    if cfg.kernels == "sm70" or (cfg.kernels == "auto" and volta):
        raise ConfigError(f"{on}: sparse attention is not built for the sm70 kernel chain (its m8n8k4 attention "
                          f"kernels take no block lists): turn {on} off, or use kernels=triton")
    if cfg.kv_offload_bytes:
        raise ConfigError(f"{on} with kv_offload_bytes is not built: KV blocks restored from the host tier would not "
                          "refresh sparse attention's page tables; set kv_offload_bytes=0")
    if cfg.sparse_block_tokens % cfg.block_size:
        raise ConfigError(f"sparse_block_tokens={cfg.sparse_block_tokens} must be a multiple of block_size="
                          f"{cfg.block_size}")
    return SparsePolicy(prefill=cfg.sparse_prefill, decode=cfg.sparse_decode, mass=cfg.sparse_mass,
                        rule=cfg.sparse_rule, min_len=cfg.sparse_min_len, top=cfg.sparse_decode_top,
                        min_blocks=cfg.sparse_decode_min_blocks, block_tokens=cfg.sparse_block_tokens)


def plan_cache(cfg: EngineConfig, mcfg: ModelConfig, device: torch.device, dtype: torch.dtype, max_model_len: int,
               mtp_layers: tuple[int, ...] = (), reserve_bytes: int = 0, weight_bytes: int = 0
               ) -> tuple[HybridCache, PrefixPlan, MemoryPlan]:
    """reserve_bytes: other device memory the engine will hold (Clef head states), off a derived budget;
    weight_bytes: what the loaded weights hold (for the plan's record)."""
    room = total = 0
    if device.type == "cuda" or cfg.device_memory_bytes:
        # this process may hold total * utilization; what it holds already (weights) counts against
        # that, and memory other processes hold is simply not free
        free, total, held = device_memory(cfg, device)
        if device.type != "cuda":  # a planned device: the weights loaded into host memory count as held there
            held, free = weight_bytes, free - weight_bytes
        room = int(min(total * cfg.gpu_memory_utilization - held, free))
    prefix, plan = plan_memory(cfg, mcfg, dtype, max_model_len, room, total, mtp_layers, reserve_bytes, weight_bytes)
    # one slot more than sequences: the last is scratch for the padding rows of captured decode graphs
    cache = allocate_cache(mcfg, plan.kv_blocks, cfg.block_size, plan.gdn_slots + 1, resolve_kv_dtype(cfg.kv_dtype, dtype),
                           STATE_DTYPES[cfg.gdn_state_dtype], dtype, device, extra_attention_layers=mtp_layers,
                           sparse=sparse_policy(cfg, device))
    return cache, prefix, plan


def device_memory(cfg: EngineConfig, device: torch.device) -> tuple[int, int, int]:
    """(free, total, held by this process) bytes of the device the plan is made for: the GPU's own, or a GPU
    of cfg.device_memory_bytes (on a real GPU no more than it has free; elsewhere an empty one)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        held = torch.cuda.memory_reserved(device)
        if cfg.device_memory_bytes:
            total = cfg.device_memory_bytes
            free = min(free, total - held)
        return free, total, held
    if not cfg.device_memory_bytes:
        raise ValueError("device_memory: a CPU device has no device memory unless device_memory_bytes sets one")
    return cfg.device_memory_bytes, cfg.device_memory_bytes, 0


def plan_memory(cfg: EngineConfig, mcfg: ModelConfig, dtype: torch.dtype, max_model_len: int, room: int, total: int,
                mtp_layers: tuple[int, ...] = (), reserve_bytes: int = 0, weight_bytes: int = 0
                ) -> tuple[PrefixPlan, MemoryPlan]:
    """The plan alone (nothing allocated). room: the GPU bytes this process may still take once its weights
    are loaded, total: the GPU's memory (both 0 on the CPU)."""
    kv_dtype = resolve_kv_dtype(cfg.kv_dtype, dtype)
    state_dtype = STATE_DTYPES[cfg.gdn_state_dtype]
    num_slots = cfg.max_gdn_slots or cfg.max_num_seqs
    per_block = max(1, kv_bytes_per_block(mcfg, cfg.block_size, kv_dtype, len(mtp_layers),
                                          sparse=cfg.sparse_prefill or cfg.sparse_decode))
    slot_bytes = gdn_bytes_per_slot(mcfg, dtype, state_dtype)
    spec_bytes = 0
    if cfg.spec != "off":  # per-position states of the verified sequences (qv/engine/speculator.py)
        spec_bytes = gdn_bytes_per_slot(mcfg, dtype, torch.float32) * (cfg.spec_k + 1) * cfg.spec_max_seqs
    if total:  # a GPU: prompt chunks' attention workspace (cuDNN on sm_90; counted on every GPU)
        reserve_bytes += prefill_workspace_bytes(mcfg, cfg.max_num_batched_tokens)
    budget = cfg.kv_cache_bytes
    if budget == 0:
        if total:
            budget = int(room * (1 - ACTIVATION_RESERVE)) - (num_slots + 1) * slot_bytes - spec_bytes - reserve_bytes
        else:
            budget = CPU_KV_BYTES
    # prefix caching takes the GDN snapshots' share of the same budget (qv/engine/prefix_cache.py)
    prefix = plan_prefix_cache(budget, per_block, slot_bytes, cfg.block_size, enabled=cfg.prefix_caching,
                               interval=cfg.gdn_snapshot_interval, chat_reserve=cfg.prefix_cache_chat_reserve,
                               offload_bytes=cfg.kv_offload_bytes)
    num_blocks = prefix.num_blocks
    if num_blocks < 1:
        raise ConfigError(f"no memory left for the KV cache (budget {budget} bytes, {per_block} bytes per block): "
                          f"lower max_num_seqs / max_gdn_slots or raise kv_cache_bytes")
    planned = num_blocks * per_block + (num_slots + 1 + prefix.num_snapshots) * slot_bytes + spec_bytes + reserve_bytes
    plan = MemoryPlan(total, cfg.gpu_memory_utilization, weight_bytes, int(num_blocks), cfg.block_size, per_block, num_slots,
                      slot_bytes, prefix.num_snapshots, spec_bytes, reserve_bytes, max(0, room - planned), max_model_len,
                      cfg.tensor_parallel_size)
    return prefix, plan
