"""What a start will hold, known before any weight is read, and the checks `qv serve` makes before it
loads: the listen port is free and the memory plan fits the device's free memory (or the planned device's,
device_memory_bytes).

The plan is build.plan_memory's, fed with the weights' bytes counted from the model config (every
tensor's shape, GPTQ codes (8 or 4 bits) + scales + group indices where the quantization rules quantize a
linear, the activation dtype for the rest; the vision tower and the MTP head only when they would load)
and the Clef head's files and record states. Its weight figure is an estimate: the real start measures
what the loaded tensors hold. Under tensor parallelism every figure is one rank's: rank 0's shard of the
weights (cut as qv/model/qwen3_5.py cuts them) and the rank's KV and GDN heads (parallel.rank_config).
A plan whose KV blocks hold less than one max_model_len sequence names the levers that would make it fit."""

from __future__ import annotations

import errno
import math
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qv.clef.adapters import clef_layout
from qv.clef.head import HeadConfig, expected_shapes, max_state_bytes
from qv.config import EngineConfig, ModelConfig
from qv.engine.build import (device_memory, plan_memory, resolve_device, resolve_dtype, resolve_max_len,
                             resolve_model_dir, sparse_policy, wants_media, wants_mtp)
from qv.engine.memory_plan import GIB, MemoryPlan
from qv.errors import ConfigError
from qv.model.parallel import rank_config
from qv.model.random_weights import RandomReader, with_quantization


@dataclass
class Preflight:
    model_dir: Path
    device: torch.device
    dtype: torch.dtype
    plan: MemoryPlan | None  # None: the weights alone do not fit
    free_bytes: int  # free GPU memory, or the host's available memory on the CPU
    needed_bytes: int  # weights + everything the plan allocates
    problems: list[str] = field(default_factory=list)  # why a start would be refused, one line each
    fit_hint: str = ""  # when one max_model_len sequence does not fit: the levers that would make it fit


def gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / (1 << 20):.1f} MiB"


def port_problem(host: str, port: int) -> str | None:
    """Why uvicorn could not listen on host:port (bound as it binds, SO_REUSEADDR), or None."""
    if port == 0:
        return None
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        return f"cannot listen on {host}:{port}: {e.strerror}"
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return f"port {port} on {host} is in use (another server?): choose another with --port or QV_PORT"
            return f"cannot listen on {host}:{port}: {e.strerror}"
    return None


# how qwen3_5.LayerBuilder cuts each module for a tensor-parallel rank (by the name's last part):
# column-parallel linears split their outputs, row-parallel ones their inputs, the embedding and lm_head
# the vocabulary; per-head vectors and the GDN conv weight follow the heads; the rest is replicated
COLUMN_LINEARS = ("q_proj", "k_proj", "v_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "gate_proj",
                  "up_proj")
ROW_LINEARS = ("o_proj", "out_proj", "down_proj")
VOCAB_TENSORS = ("embed_tokens", "lm_head")
HEAD_TENSORS = ("A_log", "dt_bias", "conv1d")
# fused members (layers.FusedLinear) share their run's first g_idx: each member after the one before it
FUSED_AFTER = {"k_proj": "q_proj", "v_proj": "k_proj", "in_proj_z": "in_proj_qkv", "in_proj_b": "in_proj_z",
               "in_proj_a": "in_proj_b", "up_proj": "gate_proj"}


def tp_split(name: str) -> str | None:
    """How tensor `name` is cut for a rank: "column", "row", "vocab", "heads" or None (replicated)."""
    if ".visual." in f".{name}":
        return None
    part = name.removesuffix(".weight").rsplit(".", 1)[-1]
    for split, parts in (("column", COLUMN_LINEARS), ("row", ROW_LINEARS), ("vocab", VOCAB_TENSORS),
                         ("heads", HEAD_TENSORS)):
        if part in parts:
            return split
    return None


def weight_bytes(mcfg: ModelConfig, dtype: torch.dtype, mtp: bool, media: bool, world: int = 1) -> int:
    """Device bytes of the weights a start loads, from their shapes (build_text_model's layout: 1-D
    vectors of the text model in fp32, GPTQ codes one byte each (two a byte at 4 bits), FP8 values one byte, the
    rest in the activation dtype); with `world` > 1, rank 0's shard of them (GPTQ groups split with the inputs of
    a row-parallel linear, g_idx kept whole by a column-parallel one)."""
    reader = RandomReader(mcfg, 0, "meta")  # names, shapes and which linears are GPTQ; makes no tensor
    size, total = dtype.itemsize, 0
    for name, shape in reader.shapes.items():
        if (name.startswith("mtp.") and not mtp) or (".visual." in f".{name}" and not media):
            continue
        module = name.removesuffix(".weight")
        split = tp_split(name) if world > 1 else None
        rows = -(-shape[0] // world) if split == "vocab" else shape[0] // world if split in ("column", "heads") \
            else shape[0]
        if name.endswith(".weight") and reader.has(f"{module}.qweight"):
            _, k = shape
            q = reader.rules.resolve(module)
            groups = 1 if q.group_size == -1 else k // q.group_size
            if split == "row":
                k, groups = k // world, max(1, groups // world)
            prefix, _, part = module.rpartition(".")
            before = f"{prefix}.{FUSED_AFTER.get(part, '')}"
            shares = part in FUSED_AFTER and reader.has(f"{before}.qweight") and reader.rules.resolve(before) == q
            g_idx = 0 if shares else 4 * k
            total += k * rows * q.bits // 8 + groups * rows * size * (1 if mcfg.quant.sym else 2) + g_idx
        elif name.endswith(".weight") and reader.has(f"{module}.weight_scale_inv"):
            _, k = shape
            bn, bk = mcfg.quant.weight_block_size
            if split == "row":
                k //= world
            total += rows * k + 4 * -(-rows // bn) * -(-k // bk)  # e4m3 values, fp32 block scales
        elif len(shape) == 1 and ".visual." not in f".{name}":
            total += 4 * rows
        else:
            cols = math.prod(shape[1:]) // (world if split == "row" else 1)
            total += rows * cols * size
    return total


def clef_bytes(cfg: EngineConfig, model_dir: Path, max_len: int) -> tuple[int, int]:
    """(weights, record states) of the Clef head when it loads: the head in fp32 (as JointHead holds it),
    the low-rank deltas' files when they stay on the device, and clef_rows.clef_reserve_bytes's states of
    clef_slots records."""
    layout = clef_layout(model_dir) if cfg.clef else None
    if layout is None:
        return 0, 0
    deltas: list[Path] = []
    if layout == "release":
        config = model_dir / "joint_head_config.json"
    else:
        clef = model_dir / "clef"
        config = (clef if (clef / "joint_head_config.json").is_file() else model_dir) / "joint_head_config.json"
        if not cfg.clef_delta_host:
            deltas = [p for p in clef.rglob("*.safetensors") if p.name != "joint_head.safetensors"]
    head = HeadConfig.from_json(config)
    weights = 4 * sum(math.prod(s) for s in expected_shapes(head).values()) + sum(p.stat().st_size for p in deltas)
    return weights, cfg.clef_slots * max_state_bytes(head, min(cfg.clef_nmax, max_len))


def host_available() -> int:
    """The host memory available to a new allocation (MemAvailable on Linux)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def preflight(cfg: EngineConfig, check_port: bool = True, hint: bool = True) -> Preflight:
    """The plan a start of `cfg` would make and why it would be refused, reading no weight. ConfigError
    (and CheckpointError / ClefLayoutError) for levers or a folder the start itself would refuse. `hint`:
    when the plan holds less than one max_model_len sequence, find the levers that would make it fit."""
    model_dir = resolve_model_dir(cfg)
    device = resolve_device(cfg.device)
    sparse_policy(cfg, device)
    dtype = resolve_dtype(cfg.dtype, device)
    mcfg = with_quantization(ModelConfig.from_dir(model_dir), cfg.quantization, cfg.load_format)
    max_len = resolve_max_len(cfg, mcfg)
    mtp = wants_mtp(cfg, mcfg)
    world = cfg.tensor_parallel_size
    rank_cfg = rank_config(mcfg, world)  # one rank's heads size its KV blocks and GDN slots
    clef_weights, reserve = clef_bytes(cfg, model_dir, max_len)
    # images and videos stay off under tensor parallelism (tensor_parallel.check_levers refuses them)
    media = world == 1 and wants_media(cfg, mcfg, model_dir)
    weights = weight_bytes(mcfg, dtype, mtp, media, world) + clef_weights
    problems = [p for p in [port_problem(cfg.host, cfg.port) if check_port else None] if p]
    room = total = 0
    if device.type == "cuda" or cfg.device_memory_bytes:
        free, total, held = device_memory(cfg, device)
        # as plan_cache computes it once the weights are in: what this process holds counts against the share
        room = int(min(total * cfg.gpu_memory_utilization - held, free)) - weights
    else:
        free = host_available()
    if total and room <= 0:
        problems.append(f"too little free GPU memory: the weights need {gib(weights)} but {device} has {gib(free)} "
                        f"free of {gib(total)} (x gpu_memory_utilization {cfg.gpu_memory_utilization})")
        check = Preflight(model_dir, device, dtype, None, free, weights, problems)
    else:
        mtp_layers = (mcfg.num_hidden_layers,) if mtp else ()
        _, plan = plan_memory(cfg, rank_cfg, dtype, max_len, room, total, mtp_layers, reserve, weights)
        needed = weights + plan.kv_bytes + plan.gdn_bytes + plan.snapshot_bytes + plan.spec_bytes + plan.other_bytes
        if needed > free:
            where = f"free on {device}" if total else "available on the host"
            problems.append(f"too little {'free GPU' if total else 'host'} memory: the plan needs {gib(needed)} "
                            f"(weights {gib(weights)}, KV {gib(plan.kv_bytes)}, GDN states "
                            f"{gib(plan.gdn_bytes + plan.snapshot_bytes)}, other "
                            f"{gib(plan.spec_bytes + plan.other_bytes)}"
                            f") but {gib(free)} is {where}: lower kv_cache_bytes / max_num_seqs or free the memory")
        check = Preflight(model_dir, device, dtype, plan, free, needed, problems)
    if hint and not holds_one(check, max_len):
        check.fit_hint = fit_hint(cfg, mcfg, check, max_len)
    return check


def holds_one(check: Preflight, max_len: int) -> bool:
    """Whether the plan starts and its KV blocks hold one sequence of max_len tokens."""
    return check.plan is not None and check.plan.kv_tokens >= max_len and not any(
        "memory" in p for p in check.problems)


def fit_candidates(cfg: EngineConfig, mcfg: ModelConfig, check: Preflight, max_len: int) -> list[dict]:
    """Single lever changes that could let one max_len sequence fit, cheapest in quality first: the
    original's long-context levers (int8 KV, int16 GDN state, no prefix snapshots, one sequence, no
    speculation buffers), then more memory (utilization 0.96, KV bytes, a second rank, 4-bit weights)."""
    out: list[dict] = []
    if cfg.kv_dtype != "int8":
        out.append(dict(kv_dtype="int8"))
    if cfg.gdn_state_dtype != "int16":
        out.append(dict(gdn_state_dtype="int16"))
    if cfg.prefix_caching:
        out.append(dict(prefix_caching=False))
    if cfg.max_num_seqs > 1 and not cfg.max_gdn_slots:
        out.append(dict(max_num_seqs=1))
    if cfg.spec != "off":
        out.append(dict(spec="off"))
    if cfg.gpu_memory_utilization < 0.96 and (check.device.type == "cuda" or cfg.device_memory_bytes):
        out.append(dict(gpu_memory_utilization=0.96))
    plan = check.plan
    if plan is not None and plan.kv_tokens < max_len and (cfg.kv_cache_bytes or not plan.device_bytes):
        per_seq = -(-max_len // plan.block_size) * plan.kv_block_bytes
        # the budget also pays for prefix snapshots: scale by what the plan's blocks got of it
        have = max(1, plan.kv_bytes + plan.snapshot_bytes)
        budget = cfg.kv_cache_bytes or have
        out.append(dict(kv_cache_bytes=int(math.ceil(per_seq * budget / max(1, plan.kv_bytes) / (1 << 20))) << 20))
    world = cfg.tensor_parallel_size * 2
    try:
        rank_config(mcfg, world)
        out.append(dict(tensor_parallel_size=world))
    except ConfigError:
        pass
    if cfg.load_format == "random" and mcfg.quant is not None and mcfg.quant.bits == 8:
        out.append(dict(quantization="gptq-int4"))
    return out


def fit_hint(cfg: EngineConfig, mcfg: ModelConfig, check: Preflight, max_len: int) -> str:
    """Which lever would make one max_len sequence fit: each single change that does, else the first
    changes that do together; or that none of them does."""
    held = f"the KV blocks hold {check.plan.kv_tokens:,} tokens" if check.plan else "the weights alone do not fit"
    head = f"one {max_len:,}-token sequence (max_model_len) does not fit ({held})"

    def tried(change: dict) -> Preflight | None:
        try:
            return preflight(cfg.model_copy(update=change), check_port=False, hint=False)
        except ConfigError:
            return None

    def words(change: dict) -> str:
        return ", ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in change.items())

    candidates = fit_candidates(cfg, mcfg, check, max_len)
    alone = [c for c in candidates if (t := tried(c)) is not None and holds_one(t, max_len)]
    if alone:
        return f"{head}: it would with " + " or ".join(words(c) for c in alone)
    together: dict = {}
    for change in candidates:
        together.update(change)
        t = tried(together)
        if t is not None and holds_one(t, max_len):
            return f"{head}: it would with {words(together)} together"
    return f"{head}, and no lever qv has makes it fit ({words(together) or 'none tried'} together do not): lower " \
           "max_model_len"
