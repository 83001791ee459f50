"""Engine throughput on the GPU: steps/s, tokens/s and the share of step time the GPU is idle
(Python and host work), at batch 1 and 32, reference ops vs Triton kernels, for the tiny model and
a 0.5B-shaped random model with GPTQ-int8 weights. Prints one table.

    python bench/engine.py [--models tiny,0.5b] [--batches 1,32] [--kernels reference,triton] [--json OUT]

Host share = 1 - (sum of GPU kernel time in the profiled steps) / (their wall time): what CUDA
graphs and fewer Python ops per layer would win back.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

import torch

from gpu_profile import kernel_table, kernel_times
from qv.config import EngineConfig
from qv.engine.engine import LLMEngine
from qv.engine.request import SamplingParams


def make_model(preset: str, root: Path) -> Path:
    from qv.model.quantize import quantize_checkpoint
    from qv.model.tiny import make_tiny

    path = root / preset
    if preset == "tiny":
        return make_tiny(path, "tiny")
    dense = make_tiny(root / f"{preset}-dense", preset, dtype=torch.bfloat16)
    quantize_checkpoint(dense, path, bits=8, group_size=128, sym=True)
    return path


def run_case(model_dir: Path, kernels: str, batch: int, prompt_len: int, decode_steps: int,
             show_kernels: bool = False) -> dict:
    cfg = EngineConfig.from_env(environ={}, model=str(model_dir), kernels=kernels, max_num_seqs=batch,
                                max_num_batched_tokens=max(2048, batch * prompt_len), max_model_len=4096,
                                gpu_memory_utilization=0.3)
    eng = LLMEngine(cfg)
    params = SamplingParams(temperature=0, max_tokens=decode_steps * 3 + 8, ignore_eos=True)
    for i in range(batch):
        eng.add_request(str(i), [(7 * i + j) % 250 + 1 for j in range(prompt_len)], params)
    while any(s.num_computed_tokens < s.num_tokens - 1 for s in eng.scheduler.running + list(eng.scheduler.waiting)):
        eng.step()  # prefill
    for _ in range(3):
        eng.step()  # warm-up decodes
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(decode_steps):
        eng.step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / decode_steps
    prof_steps = min(5, decode_steps)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        t1 = time.perf_counter()
        for _ in range(prof_steps):
            eng.step()
        torch.cuda.synchronize()
        prof_wall = (time.perf_counter() - t1) * 1e3
    gpu_ms = sum(ms for _, ms, _ in kernel_times(prof, 1))
    if show_kernels:
        print(kernel_table(prof, prof_steps), flush=True)
    del eng, prof
    gc.collect()  # the engine's parts reference each other: free its cache before the next case
    torch.cuda.empty_cache()
    return {"step_ms": wall * 1e3, "steps_s": 1 / wall, "tok_s": batch / wall,
            "host_share": max(0.0, 1 - gpu_ms / prof_wall)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="tiny,0.5b")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--kernels", default="reference,triton")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json", default=None)
    ap.add_argument("--kernel-table", action="store_true", help="also print each case's largest GPU kernels per step")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.models.split(","):
            path = make_model(preset, Path(tmp))
            for kernels in args.kernels.split(","):
                for batch in (int(b) for b in args.batches.split(",")):
                    steps = args.steps if kernels != "reference" else max(3, args.steps // 4)
                    r = run_case(path, kernels, batch, args.prompt_len, steps, args.kernel_table)
                    r.update(model=preset + ("" if preset == "tiny" else " gptq-int8"), kernels=kernels, batch=batch)
                    rows.append(r)
                    print(f"{r['model']:>16} {kernels:>9} b={batch:<3} {r['step_ms']:8.2f} ms/step "
                          f"{r['tok_s']:9.1f} tok/s host {100 * r['host_share']:5.1f}%", flush=True)
    print(f"\nGPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print("| model | kernels | batch | ms/step | steps/s | tokens/s | host/idle share |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['model']} | {r['kernels']} | {r['batch']} | {r['step_ms']:.2f} | {r['steps_s']:.1f} | "
              f"{r['tok_s']:.1f} | {100 * r['host_share']:.0f}% |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
