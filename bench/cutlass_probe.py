"""CUTLASS 3's Hopper mixed-input GEMM (bench/cutlass/w8a16.cu: int8 codes x bf16 rows, group-128 scales, six
tile shapes) beside qv's GPTQ-Int8 linear and cuBLAS bf16 on dense weights, the five 27B linears at M rows.
It answers one question for issue 32: how close a hand-scheduled kernel (TMA producer warp, conversion and
wgmma in warp-specialized consumers) comes to cuBLAS where qv's Triton GEMM does not. It needs nvcc and the
`nvidia-cutlass` package's headers (pip install nvidia-cutlass); the build goes to --build-dir.

    python bench/cutlass_probe.py [--rows 16,64,256,512,2048,8192] [--tiles 0,1,2,3,4,5]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench, do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qv.kernels.linear import GPTQWeight  # noqa: E402
from qv.kernels.linear.reference import dequantize_gptq  # noqa: E402
from qv.kernels.linear.triton import linear as qv_linear  # noqa: E402

SOURCE = Path(__file__).resolve().parent / "cutlass" / "w8a16.cu"
SHAPES = (("gdn in_proj", 5120, 16384), ("gdn out_proj", 6144, 5120), ("attn qkv", 5120, 14336),
          ("mlp gate_up", 5120, 34816), ("mlp down", 17408, 5120))
TILES = {0: "128x128 coop", 1: "128x64 coop", 2: "128x256 coop", 3: "64x128 pingpong", 4: "128x32 coop",
         5: "64x64 pingpong"}  # weight rows x activation rows per CTA


def build(build_dir: Path) -> Path:
    import cutlass_library

    root = Path(cutlass_library.__file__).parent / "source"
    out = build_dir / "w8a16.so"
    if out.is_file() and out.stat().st_mtime > SOURCE.stat().st_mtime:
        return out
    build_dir.mkdir(parents=True, exist_ok=True)
    cmd = ["nvcc", "-std=c++17", "-O3", "--expt-relaxed-constexpr", "-gencode=arch=compute_90a,code=sm_90a",
           "-Xcompiler", "-fPIC", "-shared", "-DNDEBUG", f"-I{root / 'include'}", f"-I{root / 'tools/util/include'}",
           "-o", str(out), str(SOURCE)]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return out


def t_ms(fn, m):
    fn()
    torch.cuda.synchronize()
    if m <= 1024:
        return do_bench_cudagraph(fn, rep=40, return_mode="median")
    return do_bench(fn, warmup=10, rep=60, return_mode="median")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="16,64,256,512,2048,8192")
    ap.add_argument("--tiles", default=",".join(map(str, TILES)))
    ap.add_argument("--build-dir", default=os.path.expanduser("~/.cache/qv/cutlass_probe"))
    args = ap.parse_args()
    lib = ctypes.CDLL(str(build(Path(args.build_dir))))
    gemm = lib.qv_w8a16_gemm
    gemm.argtypes = ([ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
                     + [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p])
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    workspace = torch.empty(64 << 20, dtype=torch.uint8, device=dev)
    tiles = [int(t) for t in args.tiles.split(",")]
    sums: dict[int, dict[str, float]] = {}
    for m in [int(r) for r in args.rows.split(",")]:
        for name, k, n in SHAPES:
            torch.manual_seed(0)
            w = GPTQWeight(torch.randint(0, 256, (k, n), dtype=torch.uint8, device=dev),
                           (torch.rand(k // 128, n, device=dev) * 0.002 + 1e-4).half(), None,
                           torch.arange(k, dtype=torch.int32, device=dev) // 128, 128)
            codes = (w.qweight.int() - 128).to(torch.int8).t().contiguous()  # signed, K-major [N, K]
            scales = w.scales.to(torch.bfloat16).contiguous()
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = x.float() @ dequantize_gptq(w).t()
            dense = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
            row = {"qv": t_ms(lambda: qv_linear(x, w), m), "cublas": t_ms(lambda: F.linear(x, dense), m)}
            y = torch.empty(m, n, device=dev, dtype=torch.bfloat16)

            def run(tile):  # the stream is read at call time: CUDA-graph timing captures on its own stream
                return gemm(tile, codes.data_ptr(), x.data_ptr(), scales.data_ptr(), y.data_ptr(), m, n, k, 128,
                            workspace.data_ptr(), workspace.numel(), torch.cuda.current_stream().cuda_stream, None)

            for tile in tiles:
                y.fill_(float("nan"))
                rc = run(tile)
                torch.cuda.synchronize()
                err = ((y.float() - ref).norm() / ref.norm()).item()
                if rc or not err < 2e-2:  # bf16 products: ~3e-3 expected
                    print(f"  {name} M={m} tile {TILES[tile]}: status {rc}, relative error {err:.2e}", flush=True)
                    continue
                row[f"cutlass{tile}"] = t_ms(lambda: run(tile), m)
            row["cutlass best"] = min((v for c, v in row.items() if c.startswith("cutlass")), default=float("nan"))
            print(f"  {name:12s} M={m:5d} " + " ".join(f"{c}={v:.3f}" for c, v in row.items()), flush=True)
            for c, v in row.items():
                sums.setdefault(m, {}).setdefault(c, 0.0)
                sums[m][c] += v
    print("\ntiles: " + ", ".join(f"cutlass{t} = {TILES[t]}" for t in tiles))
    for m, s in sums.items():
        print(f"| {m} | " + " | ".join(f"{c} {v:.3f}" for c, v in s.items())
              + f" | best/cuBLAS {s['cutlass best'] / s['cublas']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
