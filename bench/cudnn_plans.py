"""What a new cuDNN attention shape costs the host: torch keeps one cuDNN graph per shape for the process's life
(an unbounded cache), so every shape the prompt-attention path (qv/kernels/paged_attention/sdpa_prefill.py) meets
adds its plan's build time to a step and its memory to the server's RSS.

    python bench/cudnn_plans.py [--shapes 64]

Runs the 27B's heads (24 query, 4 KV, d 256, fp16) over shapes as chunk_attention makes them (rows a multiple of
ROW_BUCKET, keys a multiple of KEY_GRAIN), each new shape twice: the first call plans it, the second replays it.
Prints RSS and time per new shape, and the same for shapes already planned (the control)."""

import argparse
import os
import time

import torch

from qv.kernels.paged_attention import sdpa_prefill


def rss_mib() -> float:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", type=int, default=64, help="new (rows, keys) shapes to plan")
    args = ap.parse_args()
    dev, dt, hq, hkv, d = torch.device("cuda"), torch.float16, 24, 4, 256
    rows_all = [sdpa_prefill.ROW_BUCKET * i for i in range(1, 37)]
    keys_all = [sdpa_prefill.KEY_GRAIN * i for i in range(1, 33)]
    q = torch.randn(rows_all[-1], hq, d, device=dev, dtype=dt)
    kv = torch.randn(keys_all[-1], hkv, d, device=dev, dtype=dt)
    shapes = [(r, k) for k in keys_all for r in rows_all][: args.shapes]

    def call(rows, keys):
        sdpa_prefill.cudnn_attention(q[:rows], kv[:keys], kv[:keys], d ** -0.5, False)
        torch.cuda.synchronize()

    call(256, 1024)  # cuDNN's own start-up, not a shape's
    n = len(shapes)
    for label in ("new shapes", "planned shapes (control)"):  # the same shapes twice: planned by the first pass
        r0, first, second = rss_mib(), 0.0, 0.0
        for rows, keys in shapes:
            t = time.perf_counter()
            call(rows, keys)
            first += time.perf_counter() - t
            t = time.perf_counter()
            call(rows, keys)
            second += time.perf_counter() - t
        grow = rss_mib() - r0
        print(f"{label}: {n} shapes, RSS +{grow:.1f} MiB ({grow / n * 1024:.0f} KiB a shape), first call "
              f"{first / n * 1e3:.1f} ms a shape, second {second / n * 1e3:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
