"""Speculative decoding on the GPU: target forwards per generated token, mean acceptance length and
wall-clock tokens/s with and without speculation, at batch 1 and 8. Prints one table.

    python bench/spec.py --fitted DIR [--shaped 0.5b] [--batches 1,8] [--json OUT]

DIR is a tiny checkpoint fitted with `qv make-tiny --mtp --fit-mtp N --fit-copy N` (drafts that can
be right); the 0.5B-shaped model has random weights, so its rows measure the cost of speculating
when drafts are almost never accepted (the break-even floor), not a realistic speed-up.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from qv.config import EngineConfig
from qv.engine.engine import LLMEngine
from qv.engine.request import SamplingParams


def prompts(batch: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for i in range(batch):
        items = [rng.randrange(1, 64) for _ in range(rng.randrange(5, 10))]
        out.append(items * 3 if i % 2 == 0 else [rng.randrange(300) for _ in range(24)])
    return out


def run(model_dir: str, spec: str, k: int, batch: int, max_tokens: int) -> dict:
    cfg = EngineConfig.from_env(environ={}, model=model_dir, spec=spec, spec_k=k, max_num_seqs=batch,
                                max_model_len=4096, gpu_memory_utilization=0.3)
    eng = LLMEngine(cfg)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    # warm-up on the same prompts: Triton compiles per shape class, which must not land in the timing
    for i, p in enumerate(prompts(batch, 0)):
        eng.add_request(f"warm{i}", p, SamplingParams(temperature=0, max_tokens=max(8, max_tokens // 4),
                                                     ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    for i, p in enumerate(prompts(batch, 0)):
        eng.add_request(str(i), p, params)
    before = (eng.spec.stats.num_drafts, eng.spec.stats.num_accepted_tokens) if eng.spec else (0, 0)
    torch.cuda.synchronize()
    steps, t0 = 0, time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    generated = batch * max_tokens
    drafts = eng.spec.stats.num_drafts - before[0] if eng.spec else 0
    accepted = eng.spec.stats.num_accepted_tokens - before[1] if eng.spec else 0
    del eng
    gc.collect()  # free this engine's cache before the next case
    torch.cuda.empty_cache()
    return {"spec": spec if spec == "off" else f"{spec} k={k}", "batch": batch, "tok_s": generated / wall,
            "forwards_per_token": steps / max_tokens, "mean_acceptance": 1 + accepted / drafts if drafts else 1.0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fitted", required=True)
    ap.add_argument("--shaped", default="0.5b")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    models = [("tiny fitted", args.fitted)]
    tmp = tempfile.TemporaryDirectory()
    if args.shaped:
        from qv.model.tiny import make_tiny

        shaped = make_tiny(Path(tmp.name) / args.shaped, args.shaped, mtp=True, dtype=torch.bfloat16)
        models.append((f"{args.shaped} random", str(shaped)))
    rows = []
    for name, path in models:
        for batch in (int(b) for b in args.batches.split(",")):
            for spec, k in (("off", 0), ("mtp", 3), ("ngram", 3), ("auto", 3)):
                r = run(path, spec, max(k, 1), batch, args.max_tokens)
                r["model"] = name
                rows.append(r)
                print(r, flush=True)
    print(f"\nGPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print("| model | batch | speculation | target forwards / token | mean acceptance length | tokens/s |")
    print("| --- | ---: | --- | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['model']} | {r['batch']} | {r['spec']} | {r['forwards_per_token']:.2f} | "
              f"{r['mean_acceptance']:.2f} | {r['tok_s']:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
