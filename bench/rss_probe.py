"""Where a GPU server's anonymous resident memory grows under load: each suspect run alone, its RssAnon
(/proc/self/status) before and after, per call.

Suspects, from the 27B soak (anonymous RSS +0.26 MiB/s with no compile, +~15 MiB a compile):
  cublas:  torch.mm at many distinct row counts (a prefill chunk's rows are any number), three weight shapes;
  pinned:  pinned host buffers of many sizes (each step's results are copied into one);
  compile: Triton compiles of one small kernel (a new constexpr each).

    python bench/rss_probe.py [--rows 2000] [--compiles 8]
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch
import triton
import triton.language as tl


def rss_anon_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


@triton.jit
def _scale_kernel(x_ptr, n, F: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + o, tl.load(x_ptr + o, mask=o < n) * F, mask=o < n)


def probe(name: str, calls: int, run) -> None:
    torch.cuda.synchronize()
    before, t0 = rss_anon_mib(), time.perf_counter()
    marks = []
    for i in range(calls):
        run(i)
        if (i + 1) % max(1, calls // 4) == 0:
            torch.cuda.synchronize()
            marks.append(f"{rss_anon_mib() - before:+.1f}")
    torch.cuda.synchronize()
    grown = rss_anon_mib() - before
    print(f"| {name} | {calls} | {grown:+.1f} | {1024 * grown / calls:.1f} | {' '.join(marks)} | "
          f"{time.perf_counter() - t0:.1f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2000, help="distinct row counts of the cuBLAS probe")
    ap.add_argument("--compiles", type=int, default=8)
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(dev), "torch", torch.__version__, "triton", triton.__version__)
    rng = random.Random(0)
    shapes = [(5120, 17408), (17408, 5120), (5120, 10240)]  # (K, N): the 27B's MLP and a GDN projection
    weights = [torch.randn(k, n, device=dev, dtype=torch.bfloat16) for k, n in shapes]
    x = torch.randn(8192, 17408, device=dev, dtype=torch.bfloat16)
    for w in weights:  # the first call of each shape loads cuBLAS's kernels: not the growth asked about
        for m in (64, 512, 4096):
            x[:m, :w.shape[0]] @ w
    rows = rng.sample(range(65, 8193), args.rows)
    repeat = [rows[i % 50] for i in range(args.rows)]
    print("| probe | calls | RssAnon growth (MiB) | KiB a call | growth at each quarter | s |")
    print("|---|---:|---:|---:|---|---:|")
    probe("cublas: the same 50 row counts", args.rows, lambda i: x[:repeat[i], :weights[i % 3].shape[0]] @ weights[i % 3])
    probe("cublas: distinct row counts", args.rows, lambda i: x[:rows[i], :weights[i % 3].shape[0]] @ weights[i % 3])
    sizes = [rng.randrange(64, 1 << 16) for _ in range(args.rows)]
    probe("pinned: host buffers of random sizes", args.rows,
          lambda i: torch.empty(sizes[i], dtype=torch.uint8, pin_memory=True).copy_(torch.ones(1, dtype=torch.uint8)))
    y = torch.ones(1 << 16, device=dev)
    probe("compile: a new Triton variant", args.compiles, lambda i: _scale_kernel[(64,)](y, y.numel(), F=1.0 + i, BLOCK=1024))
    probe("compile: the same variants again", args.compiles,
          lambda i: _scale_kernel[(64,)](y, y.numel(), F=1.0 + i, BLOCK=1024))


if __name__ == "__main__":
    main()
