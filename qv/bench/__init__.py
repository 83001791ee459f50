"""`qv bench`: the whole model at the size users serve, in one command (vLLM's `bench latency`
and `bench throughput` in one table). Decode ms/step by batch size and context, prefill seconds by
prompt length, each beside its floor measured in the same run (qv/bench/floors.py).

    report = run_bench(engine_config, BenchSpec(...), label)   # the --json record
    print(markdown(report))
"""

from __future__ import annotations

import gc
import tempfile
import time

import torch

from qv.bench import peers
from qv.bench.floors import ModelFloors, measure_ceilings
from qv.bench.presets import bench_config, write_preset
from qv.bench.report import build_report, markdown, row_record
from qv.bench.run import BenchRun, BenchSpec
from qv.config import ConfigError, EngineConfig

__all__ = ["BenchSpec", "bench", "markdown", "run_bench"]


def run_bench(cfg: EngineConfig, spec: BenchSpec, label: str) -> dict:
    """Ceilings first (before the engine plans its memory), then the engine, then every row."""
    from qv.engine.build import resolve_device, resolve_dtype
    from qv.engine.engine import LLMEngine

    if 0 < cfg.max_model_len < spec.longest:  # before minutes of start-up
        raise ConfigError(f"the rows need max_model_len >= {spec.longest} (longest prompt plus the decode steps), "
                          f"got {cfg.max_model_len}")
    device = resolve_device(cfg.device)
    act_dtype = resolve_dtype(cfg.dtype, device)
    ceilings = measure_ceilings(device, act_dtype)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    engine = LLMEngine(cfg)
    start_s = time.perf_counter() - t0
    if engine.max_model_len < spec.longest:
        raise ConfigError(f"the rows need max_model_len >= {spec.longest} (longest prompt plus the decode steps), "
                          f"the engine has {engine.max_model_len}")
    floors = ModelFloors.from_levers(engine.model_config, act_dtype, cfg.kv_dtype, cfg.gdn_state_dtype)
    if engine.model_config.quant is not None:
        q = engine.model_config.quant
        if q.method == "fp8":
            label += f", FP8 blocks {q.weight_block_size[0]}x{q.weight_block_size[1]}"
        else:
            label += f", {'AWQ' if q.method == 'awq' else f'GPTQ-Int{q.bits}'} group {q.group_size}"
    bench_run = BenchRun(engine, spec)
    rows = [row_record(m, floors, ceilings) for m in bench_run.run()]
    report = build_report(label=label, device=device, cfg=cfg, ceilings=ceilings, start_s=start_s,
                          cuda_graphs=engine.runner.graphs is not None,
                          memory_plan=getattr(engine, "memory_plan", None), rows=rows, profiles=bench_run.profiles)
    report["spec"], report["spec_prefill"] = bench_run.spec_records, bench_run.spec_prefill
    mcfg = engine.model_config
    del bench_run, engine
    gc.collect()  # the engine's parts reference each other: free its cache before anything else runs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if spec.linears:
        report["linears"] = peers.linear_table(mcfg, device, act_dtype, ceilings)
    if spec.attention:
        report["attention"] = peers.attention_table(mcfg, device, act_dtype, ceilings)
    return report


def bench(spec: BenchSpec, flags: dict, model: str | None = None, preset: str | None = None) -> dict:
    """`qv bench`: a preset (written as a config.json into a temporary folder, random weights) or a
    model folder (the levers decide how it loads), with `flags` the levers given on the command line."""
    if model is not None and preset is not None:
        raise ConfigError("give a model folder or --preset, not both")
    if preset is None:
        cfg = bench_config(flags, model, None, spec.longest, spec.max_batch)
        return run_bench(cfg, spec, str(cfg.model or "the embedded tiny model"))
    with tempfile.TemporaryDirectory(prefix=f"qv-bench-{preset}-") as tmp:
        cfg = bench_config(flags, str(write_preset(preset, tmp)), preset, spec.longest, spec.max_batch)
        return run_bench(cfg, spec, f"preset {preset} (random weights)")
