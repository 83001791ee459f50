"""GPTQ-int8 linears at decode batch sizes (M = 1..64 rows) and the 27B layer shapes: each config's
CUDA-graph replay time against the weight-read floor (codes + scales over the copy bandwidth measured
in the same run) and the bf16 matmul rate. Explains the batch 16-64 lines of `qv bench --preset 27b`:
a decode step at batch B runs every linear at M = B.

    python bench/gemm_rows.py [--rows 16,24,32,48,64] [--sweep]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernel_inputs import gptq_inputs  # noqa: E402
from kernels import ceilings, graph_ms  # noqa: E402
from qv.kernels import cuda_build  # noqa: E402
from qv.kernels.linear.reference import dequantize_gptq  # noqa: E402
from qv.kernels.linear.triton import linear as linear_triton  # noqa: E402

DEV = torch.device("cuda")
# (name, K, N) of every linear in a 27B decoder layer (GDN qkvz and out, attention qkv and o, the MLP)
SHAPES = (("gdn in_proj_qkvz", 5120, 16384), ("gdn in_proj_ba", 5120, 96), ("gdn out_proj", 6144, 5120),
          ("attn qkv", 5120, 14336),
          ("mlp gate_up", 5120, 34816), ("mlp down", 17408, 5120))
SWEEP = ([dict(kind="dot", x_f16=xf, asm=asm, waves=wv, BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4,
               num_stages=4, GROUP_M=1, split=None)
          for xf in (False, True) for asm in (False, True) for wv in (4, 2)]
         + [dict(kind="dot", x_f16=True, asm=True, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=st,
                 GROUP_M=1, split=None)
            for bm, bn, bk, nw, st in ((64, 128, 64, 8, 3), (32, 256, 64, 8, 3), (64, 64, 128, 4, 4),
                                       (64, 256, 64, 8, 3))])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="16,24,32,48,64")
    ap.add_argument("--sweep", action="store_true", help="also time the candidate tile configs")
    args = ap.parse_args()
    cuda_build.EAGER_ALWAYS = True
    lim = ceilings()
    print("| linear | M | default us | best us | floor us | default/floor | best config |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    totals: dict[int, list[float]] = {}
    for m in (int(r) for r in args.rows.split(",")):
        for name, k, n in SHAPES:
            w, x = gptq_inputs(k, n, m, DEV)
            x = x.to(torch.bfloat16)
            ref = torch.nn.functional.linear(x.float(), dequantize_gptq(w).float())
            floor_us = (k * n + w.scales.numel() * 2) / (lim["copy_tbs"] * 1e12) * 1e6
            times = {}
            for cfg in [None] + (SWEEP if args.sweep else []):
                try:
                    y = linear_triton(x, w, config=cfg)
                    err = ((y.float() - ref).norm() / ref.norm()).item()
                    t = graph_ms([lambda c=cfg: linear_triton(x, w, config=c)])
                except Exception as e:  # a config that does not compile is reported, not fatal
                    print(f"    {name} M={m} {cfg}: failed {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                if t is None or err > 2e-2:
                    print(f"    {name} M={m} {cfg}: rel err {err:.1e}, time {t}", flush=True)
                    continue
                times[str(cfg)] = t * 1e3
            default = times.get("None", float("nan"))
            best_cfg, best = min(times.items(), key=lambda kv: kv[1])
            totals.setdefault(m, [0.0, 0.0, 0.0])
            for i, v in enumerate((default, best, floor_us)):
                totals[m][i] += v
            print(f"| {name} | {m} | {default:.1f} | {best:.1f} | {floor_us:.1f} | {default / floor_us:.2f} | "
                  f"{best_cfg} |", flush=True)
            del w, x, ref
    for m, (d, b, f) in totals.items():
        print(f"layer sum M={m}: default {d:.1f} us, best {b:.1f} us, floor {f:.1f} us")


if __name__ == "__main__":
    main()
