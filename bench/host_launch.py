"""Host time per call of the decode-path kernels when launched eagerly (no CUDA graph), as the engine's
speculative-verification and Clef delta-row steps run them: the CPU time of N back-to-back calls with no
synchronisation in between, for the raw-CUDA kernels (CuPy launches) and their Triton twins. Prints a
table; the GPU time of the same calls is bench/kernels.py's.

    python bench/host_launch.py [--calls 300]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernel_inputs import decode_inputs, gptq_inputs  # noqa: E402
from qv.kernels import cuda_build  # noqa: E402
from qv.kernels.linear.triton import linear as linear_triton  # noqa: E402
from qv.kernels.paged_attention.triton import paged_attention as paged_attention_triton  # noqa: E402


cuda_build.EAGER_ALWAYS = True  # eager calls run the raw-CUDA kernels too (their GPU time is measured)


def host_us(fn, calls: int) -> float:
    """Median over 5 rounds of the CPU time per call of `calls` eager calls (the GPU drains in between)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return sorted(rounds)[2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args()
    dev = torch.device("cuda")
    dec = decode_inputs(1024, 1, dev)  # a short context: the GPU finishes first, the host time shows
    spec = decode_inputs(1024, 1, dev, 4)
    w, x1 = gptq_inputs(5120, 5120, 1, dev)
    x4 = torch.randn(4, 5120, device=dev, dtype=torch.float16)
    cases = [("decode 1K x1", lambda c: paged_attention_triton(*dec, config=c), "cuda", "split"),
             ("decode 1K x1, 4 query tokens", lambda c: paged_attention_triton(*spec, config=c), "cuda", "split"),
             ("GEMV 5120->5120 M=1", lambda c: linear_triton(x1, w, config=c), "cuda", "fma"),
             ("GEMV 5120->5120 M=4", lambda c: linear_triton(x4, w, config=c), "cuda", "mma")]
    print("| call | raw CUDA (CuPy launch) us | Triton us |\n|---|---|---|")
    for name, fn, ours, twin in cases:
        print(f"| {name} | {host_us(lambda: fn(dict(kind=ours)), args.calls):.1f} | "
              f"{host_us(lambda: fn(dict(kind=twin)), args.calls):.1f} |", flush=True)


if __name__ == "__main__":
    main()
