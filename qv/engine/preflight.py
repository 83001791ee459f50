"""What a start will hold, known before any weight is read, and the checks `qv serve` makes before it
loads: the listen port is free and the memory plan fits the device's free memory (or the planned device's,
device_memory_bytes).

The plan is build.plan_memory's, fed with the weights' bytes counted from the model config (every
tensor's shape, GPTQ codes (8 or 4 bits) + scales + group indices where the quantization rules quantize a
linear, the activation dtype for the rest; the vision tower and the MTP head only when they would load)
and the Clef head's files and record states. Its weight figure is an estimate: the real start measures
what the loaded tensors hold."""

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
                             resolve_model_dir, wants_media, wants_mtp)
from qv.engine.memory_plan import GIB, MemoryPlan
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


def weight_bytes(mcfg: ModelConfig, dtype: torch.dtype, mtp: bool, media: bool) -> int:
    """Device bytes of the weights a start loads, from their shapes (build_text_model's layout: 1-D
    vectors of the text model in fp32, GPTQ codes one byte each (two a byte at 4 bits), FP8 values one byte, the
    rest in the activation dtype)."""
    reader = RandomReader(mcfg, 0, "meta")  # names, shapes and which linears are GPTQ; makes no tensor
    size, total = dtype.itemsize, 0
    for name, shape in reader.shapes.items():
        if (name.startswith("mtp.") and not mtp) or (".visual." in f".{name}" and not media):
            continue
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and reader.has(f"{module}.qweight"):
            n, k = shape
            q = reader.rules.resolve(module)
            groups = 1 if q.group_size == -1 else k // q.group_size
            total += k * n * q.bits // 8 + groups * n * size * (1 if mcfg.quant.sym else 2) + 4 * k
        elif name.endswith(".weight") and reader.has(f"{module}.weight_scale_inv"):
            (n, k), (bn, bk) = shape, mcfg.quant.weight_block_size
            total += n * k + 4 * -(-n // bn) * -(-k // bk)  # e4m3 values, fp32 block scales
        elif len(shape) == 1 and ".visual." not in f".{name}":
            total += 4 * shape[0]
        else:
            total += math.prod(shape) * size
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


def preflight(cfg: EngineConfig, check_port: bool = True) -> Preflight:
    """The plan a start of `cfg` would make and why it would be refused, reading no weight. ConfigError
    (and CheckpointError / ClefLayoutError) for levers or a folder the start itself would refuse."""
    model_dir = resolve_model_dir(cfg)
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    mcfg = with_quantization(ModelConfig.from_dir(model_dir), cfg.quantization, cfg.load_format)
    max_len = resolve_max_len(cfg, mcfg)
    mtp = wants_mtp(cfg, mcfg)
    clef_weights, reserve = clef_bytes(cfg, model_dir, max_len)
    weights = weight_bytes(mcfg, dtype, mtp, wants_media(cfg, mcfg, model_dir)) + clef_weights
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
        return Preflight(model_dir, device, dtype, None, free, weights, problems)
    mtp_layers = (mcfg.num_hidden_layers,) if mtp else ()
    _, plan = plan_memory(cfg, mcfg, dtype, max_len, room, total, mtp_layers, reserve, weights)
    needed = weights + plan.kv_bytes + plan.gdn_bytes + plan.snapshot_bytes + plan.spec_bytes + plan.other_bytes
    if needed > free:
        where = f"free on {device}" if total else "available on the host"
        problems.append(f"too little {'free GPU' if total else 'host'} memory: the plan needs {gib(needed)} (weights "
                        f"{gib(weights)}, KV {gib(plan.kv_bytes)}, GDN states {gib(plan.gdn_bytes + plan.snapshot_bytes)}"
                        f", other {gib(plan.spec_bytes + plan.other_bytes)}) but {gib(free)} is {where}: lower "
                        "kv_cache_bytes / max_num_seqs or free the memory")
    return Preflight(model_dir, device, dtype, plan, free, needed, problems)
