"""`qv bench`'s output: each measured row beside its floor, the run's environment (device,
versions, date, ceilings, start time, peak memory, graphs, levers) as one record for --json, and
the same record as a header block and one markdown table."""

from __future__ import annotations

import dataclasses
import datetime
import platform

import torch

from qv.version import __version__
from qv.bench import peers
from qv.bench.floors import Ceilings, ModelFloors, floor_s
from qv.bench.profile import profile_markdown
from qv.bench.run import Measured
from qv.bench.spec_parts import spec_table
from qv.config import EngineConfig

GIB = 1 << 30


def versions() -> dict:
    out = {"qv": __version__, "torch": torch.__version__, "triton": None, "cupy": None}
    for name in ("triton", "cupy"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - absent or broken: reported as missing
            pass
    return out


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def levers_changed(cfg: EngineConfig) -> dict:
    """Every lever whose value differs from its default (the model folder aside)."""
    default = EngineConfig()
    return {name: getattr(cfg, name) for name in EngineConfig.model_fields
            if name != "model" and getattr(cfg, name) != getattr(default, name)}


def memory_plan_dict(plan) -> dict | None:
    """The engine's memory plan as a dict (a dict already, or a record with as_dict / a dataclass)."""
    if plan is None or isinstance(plan, dict):
        return plan
    if hasattr(plan, "as_dict"):
        return plan.as_dict()
    if dataclasses.is_dataclass(plan):
        return dataclasses.asdict(plan)
    return None


def row_record(m: Measured, floors: ModelFloors, ceilings: Ceilings) -> dict:
    """A measured row with its footprint, floor and ratio (floor / measured: 1.0 is the floor)."""
    fp = floors.decode(m.batch, m.context_read) if m.kind == "decode" else floors.prefill(m.tokens)
    floor = floor_s(m.kind, fp, ceilings)
    work = m.batch if m.kind == "decode" else m.tokens  # tokens one step (decode) or the prefill makes
    return {"kind": m.kind, "batch": m.batch, "tokens": m.tokens, "measured_s": m.measured_s, "floor_s": floor,
            "floor_ratio": floor / m.measured_s, "bound": "bytes" if m.kind == "decode" else "flops",
            "weight_bytes": fp.weight_bytes, "kv_bytes": fp.kv_bytes, "state_bytes": fp.state_bytes,
            "flops": fp.flops, "tokens_per_s": work / m.measured_s, "steps": m.steps, "context_read": m.context_read}


def build_report(*, label: str, device: torch.device, cfg: EngineConfig, ceilings: Ceilings, start_s: float,
                 cuda_graphs: bool, memory_plan, rows: list[dict], profiles: list[dict]) -> dict:
    """The --json record: the run's environment and ceilings at the top level, `rows` (row_record:
    measured_s per step for decode, for the whole prefill; floor_s, floor_ratio = floor_s / measured_s,
    the bytes and FLOPs behind the floor), and `profile` (profile_steps records, with batch and context)."""
    cuda = device.type == "cuda"
    return {
        "model": label, "device": str(device), "gpu": device_name(device), "versions": versions(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "copy_bytes_per_s": ceilings.copy_bytes_per_s, "matmul_flops_per_s": ceilings.matmul_flops_per_s,
        "matmul_dtype": ceilings.matmul_dtype, "start_s": start_s,
        "peak_memory_allocated_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
        "peak_memory_reserved_bytes": torch.cuda.max_memory_reserved(device) if cuda else None,
        "cuda_graphs": cuda_graphs, "levers": levers_changed(cfg), "memory_plan": memory_plan_dict(memory_plan),
        "memory_plan_summary": memory_plan.summary() if hasattr(memory_plan, "summary") else None,
        "rows": rows, "profile": profiles,
    }


def _seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    return f"{s * 1e3:.2f} ms" if s >= 1e-3 else f"{s * 1e6:.1f} us"


def _ratio(x: float) -> str:
    return f"{x:.2f}" if x >= 0.01 else f"{x:.1e}"


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else f"{n:,}"


def header(r: dict) -> str:
    v = r["versions"]
    peak = "n/a on CPU"
    if r["peak_memory_allocated_bytes"] is not None:
        peak = (f"{r['peak_memory_allocated_bytes'] / GIB:.1f} GiB allocated, "
                f"{r['peak_memory_reserved_bytes'] / GIB:.1f} GiB reserved")
    levers = ", ".join(f"{k}={val}" for k, val in r["levers"].items()) or "all defaults"
    lines = [f"# qv bench: {r['model']}", "",
             f"- device: {r['gpu']} ({r['device']}); torch {v['torch']}, triton {v['triton']}, cupy {v['cupy']}, "
             f"qv {v['qv']}; {r['date']}",
             f"- ceilings measured in this run: copy {r['copy_bytes_per_s'] / 1e9:.1f} GB/s (read + write), "
             f"matmul {r['matmul_flops_per_s'] / 1e12:.2f} TFLOP/s ({r['matmul_dtype']})",
             f"- engine start {r['start_s']:.1f} s; peak memory {peak}; decode CUDA graphs "
             f"{'on' if r['cuda_graphs'] else 'off'}",
             f"- levers: {levers}"]
    plan = r["memory_plan"]
    if r["memory_plan_summary"]:
        lines.append(f"- {r['memory_plan_summary']}")
    elif plan:
        lines.append("- memory plan: " + ", ".join(f"{k}={val}" for k, val in plan.items()))
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    lines = ["| row | batch | tokens | measured | floor | floor/measured | tokens/s |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in rows:
        what = "decode (per step)" if row["kind"] == "decode" else "prefill (to first token)"
        lines.append(f"| {what} | {row['batch']} | {_tokens(row['tokens'])} | {_seconds(row['measured_s'])} | "
                     f"{_seconds(row['floor_s'])} | {_ratio(row['floor_ratio'])} | {row['tokens_per_s']:,.1f} |")
    return "\n".join(lines)


def markdown(r: dict) -> str:
    """The whole report: header block, the table, what the floors are, then any profiles."""
    parts = [header(r), "", table(r["rows"]), "",
             "floor: decode = bytes a step must read (weights, KV, GDN state) / copy rate; prefill = FLOPs / "
             "matmul rate (qv/bench/floors.py). floor/measured 1.00 is the hardware limit."]
    if r.get("spec") or r.get("spec_prefill"):
        parts += ["", spec_table(r.get("spec", []), r.get("spec_prefill", []))]
    if r.get("linears"):
        parts += ["", "GPTQ-Int8 and block-FP8 linears beside cuBLAS bf16 on dense weights (`--linears`):", "",
                  peers.linear_markdown(r["linears"])]
    if r.get("attention"):
        parts += ["", "A prompt chunk over the int8 paged cache beside SDPA on bf16 keys (`--attention`):", "",
                  peers.attention_markdown(r["attention"])]
    for p in r["profile"]:
        what = (f"the last prefill chunk of a {_tokens(p['context'])}-token prompt" if p.get("kind") == "prefill"
                else f"one decode step at batch {p['batch']}, {_tokens(p['context'])} context")
        parts += ["", profile_markdown(what, p)]
    return "\n".join(parts)
