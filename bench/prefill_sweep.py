"""Sweep of the tensor-core GPTQ GEMM (qv/kernels/linear/triton_gemm.py) and the cuDNN chunk attention
(qv/kernels/paged_attention/sdpa_prefill.py) beside today's kernels, cuBLAS bf16 / SDPA and the floors, at
the 27B shapes. Prints per-config rows and, last, per-M sums of the five linears.

    python bench/prefill_sweep.py [--rows 16,64,256,512,2048,8192] [--only gemm,attn]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench, do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_inputs import BS, D, HKV, HQ, _paged  # noqa: E402
from kernels import ceilings  # noqa: E402
from qv.kernels.linear import GPTQWeight  # noqa: E402
from qv.kernels.linear.reference import dequantize_gptq  # noqa: E402
from qv.kernels.linear.triton import dequant_matmul, linear as linear_triton  # noqa: E402
from qv.kernels.linear.triton_gemm import gemm  # noqa: E402
from qv.kernels.paged_attention import sdpa_prefill  # noqa: E402
from qv.kernels.paged_attention.reference import paged_attention as attention_ref  # noqa: E402
from qv.kernels.paged_attention.triton import paged_attention as paged_attention_triton  # noqa: E402

DEV = torch.device("cuda")
SHAPES = (("gdn in_proj", 5120, 16384), ("gdn out_proj", 6144, 5120), ("attn qkv", 5120, 14336),
          ("mlp gate_up", 5120, 34816), ("mlp down", 17408, 5120))


def cfg(bm, bn, bk, nw, st, waves=1, **kw):
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, STAGES=st, waves=waves, **kw)


SMALL = {"s16": cfg(16, 128, 128, 4, 4, 2), "s16n256": cfg(16, 256, 128, 4, 4, 2),
         "w64x16": cfg(16, 64, 128, 4, 4, 2, SWAP=True), "w128x16": cfg(16, 128, 128, 8, 4, 2, SWAP=True),
         "w64x32": cfg(32, 64, 128, 4, 4, 2, SWAP=True), "w128x32": cfg(32, 128, 128, 8, 4, 2, SWAP=True),
         "w64x64": cfg(64, 64, 128, 4, 4, 2, SWAP=True), "w128x64": cfg(64, 128, 64, 8, 4, 2, SWAP=True),
         "w64x16k64": cfg(16, 64, 64, 4, 6, 4, SWAP=True), "w64x16ptr": cfg(16, 64, 128, 4, 4, 2, SWAP=True, tma=False)}
MID = {"m128w4": cfg(128, 128, 64, 4, 4), "w128x128": cfg(128, 128, 64, 8, 4, SWAP=True),
       "w64x128": cfg(128, 64, 64, 4, 4, SWAP=True), "w128x64": cfg(64, 128, 64, 8, 4, SWAP=True),
       "w128x256": cfg(256, 128, 64, 8, 3, SWAP=True), "w128x128k128": cfg(128, 128, 128, 8, 3, SWAP=True),
       "w128x128bf": cfg(128, 128, 64, 8, 4, SWAP=True, f16=False),
       "w128x128ptr": cfg(128, 128, 64, 8, 4, SWAP=True, tma=False), "w64x128k128": cfg(128, 64, 128, 4, 3, SWAP=True)}
LARGE = {"l256": cfg(256, 128, 64, 8, 3), "w128x256": cfg(256, 128, 64, 8, 3, SWAP=True),
         "w256x128": cfg(128, 256, 64, 8, 3, SWAP=True), "w128x128": cfg(128, 128, 64, 8, 4, SWAP=True),
         "w128x256bf": cfg(256, 128, 64, 8, 3, SWAP=True, f16=False), "w128x256g16": cfg(256, 128, 64, 8, 3,
                                                                                      SWAP=True, GROUP_M=16)}
CHUNKS = (1024, 2048, 4096, 8192)  # columns a dequantized chunk holds (L2-resident) before cuBLAS reads it


def t_ms(fn, m):
    fn()
    torch.cuda.synchronize()
    if m <= 1024:
        return do_bench_cudagraph(fn, rep=40, return_mode="median")
    return do_bench(fn, warmup=20, rep=120, return_mode="median")


def sweep_gemm(rows, lim):
    sums: dict[int, dict[str, float]] = {}
    for m in rows:
        configs = SMALL if m <= 64 else MID if m <= 1024 else LARGE
        for name, k, n in SHAPES:
            w = GPTQWeight(torch.randint(0, 256, (k, n), dtype=torch.uint8, device=DEV),
                           (torch.rand(k // 128, n, device=DEV) * 0.002 + 1e-4).half(), None,
                           torch.arange(k, dtype=torch.int32, device=DEV) // 128, 128)
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            ref = x.float() @ dequantize_gptq(w).t()
            wd = torch.randn(n, k, device=DEV, dtype=torch.bfloat16)
            res = {"floor": (k * n + w.scales.numel() * 2) / (lim["copy_tbs"] * 1e12) * 1e3,
                   "mmfloor": 2 * m * k * n / (lim["mm_tflops"] * 1e12) * 1e3}
            res["today"] = t_ms(lambda: linear_triton(x, w), m)
            res["cublas"] = t_ms(lambda: F.linear(x, wd), m)
            out = torch.empty(m, n, device=DEV, dtype=torch.bfloat16)
            for cname, c in configs.items():
                try:
                    out.fill_(float("nan"))
                    if not gemm(x, w, None, out, c):
                        print(f"  {name} M={m} {cname}: does not apply", flush=True)
                        continue
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    if not err < 1e-2:
                        print(f"  {name} M={m} {cname}: rel err {err:.2e}", flush=True)
                        continue
                    res[cname] = t_ms(lambda: gemm(x, w, None, out, c), m)
                except Exception as e:  # a config that does not compile is reported, not fatal
                    print(f"  {name} M={m} {cname}: {type(e).__name__}: {str(e).splitlines()[0][:150]}", flush=True)
            if m >= 256:
                for cols in CHUNKS:
                    out.fill_(float("nan"))
                    dequant_matmul(x, w, None, out, cols)
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    if err < 1e-2:
                        res[f"chunk{cols}"] = t_ms(lambda: dequant_matmul(x, w, None, out, cols), m)
                    else:
                        print(f"  {name} M={m} chunk{cols}: rel err {err:.2e}", flush=True)
            best = min((v, c) for c, v in res.items() if c not in ("floor", "mmfloor", "today", "cublas"))
            print(f"  {name:12s} M={m:5d} floor {res['floor']:.3f} mm {res['mmfloor']:.3f} today {res['today']:.3f} "
                  f"cublas {res['cublas']:.3f} best {best[0]:.3f} ({best[1]}) | "
                  + " ".join(f"{c}={v:.3f}" for c, v in res.items()
                             if c not in ("floor", "mmfloor", "today", "cublas")), flush=True)
            res["best"] = best[0]
            for c, v in res.items():
                sums.setdefault(m, {}).setdefault(c, 0.0)
                sums[m][c] += v
            del w, x, ref, wd, out
            torch.cuda.empty_cache()
    print("\n| M | today | cuBLAS bf16 | best-per-shape | best one config | floor (weights) | floor (FLOPs) |")
    for m, s in sums.items():
        one = min((v, c) for c, v in s.items() if c not in ("floor", "mmfloor", "today", "cublas", "best"))
        print(f"| {m} | {s['today']:.3f} | {s['cublas']:.3f} | {s['best']:.3f} | {one[0]:.3f} ({one[1]}) | "
              f"{s['floor']:.3f} | {s['mmfloor']:.3f} |", flush=True)


def check_attention():
    """cuDNN's result and log-sum-exp against the fp32 reference on a small int8 case (odd lengths)."""
    torch.manual_seed(0)
    kc, vc, ks, vs, bt = _paged(1000, 1, DEV, torch.int8)
    L, n = 300, 1000
    q = torch.randn(L, HQ, D, device=DEV, dtype=torch.bfloat16)
    cu = torch.tensor([0, L], dtype=torch.int32, device=DEV)
    sl = torch.tensor([n], dtype=torch.int32, device=DEV)
    ref = attention_ref(q, kc, vc, bt, cu, sl, D ** -0.5, ks, vs).float()
    for piece in (1024, 256, 96):
        out = torch.full_like(q, float("nan"))
        sdpa_prefill.chunk_attention(q, kc, vc, ks, vs, bt[0], n, D ** -0.5, out, piece)
        err = ((out.float() - ref).norm() / ref.norm()).item()
        print(f"  chunk_attention piece {piece}: rel err vs fp32 reference {err:.2e}", flush=True)
    today = paged_attention_triton(q, kc, vc, bt, cu, sl, D ** -0.5, ks, vs, L, n).float()
    print(f"  today's kernel: rel err {((today - ref).norm() / ref.norm()).item():.2e}", flush=True)


def sweep_attention(lim, chunk=8192):
    for ctx in (32768, 131072):
        kc, vc, ks, vs, bt = _paged(ctx, 1, DEV, torch.int8)
        q = torch.randn(chunk, HQ, D, device=DEV, dtype=torch.bfloat16)
        cu = torch.tensor([0, chunk], dtype=torch.int32, device=DEV)
        sl = torch.tensor([ctx], dtype=torch.int32, device=DEV)
        flops = 4 * chunk * HQ * D * (ctx - chunk + chunk / 2)
        floor = flops / (lim["mm_tflops"] * 1e12) * 1e3
        today = do_bench(lambda: paged_attention_triton(q, kc, vc, bt, cu, sl, D ** -0.5, ks, vs, chunk, ctx),
                         warmup=20, rep=300, return_mode="median")
        kd = torch.randn(ctx, HKV, D, device=DEV, dtype=torch.bfloat16)
        vd = torch.randn(ctx, HKV, D, device=DEV, dtype=torch.bfloat16)
        qs = q.transpose(0, 1)[None]
        kp, vp = kd[: ctx - chunk].transpose(0, 1)[None], vd[: ctx - chunk].transpose(0, 1)[None]
        kself, vself = kd[ctx - chunk:].transpose(0, 1)[None], vd[ctx - chunk:].transpose(0, 1)[None]
        peer = do_bench(lambda: (F.scaled_dot_product_attention(qs, kp, vp, enable_gqa=True),
                                 F.scaled_dot_product_attention(qs, kself, vself, is_causal=True, enable_gqa=True)),
                        warmup=20, rep=300, return_mode="median")
        peer_cudnn = do_bench(lambda: (sdpa_prefill.cudnn_attention(q, kd[: ctx - chunk], vd[: ctx - chunk],
                                                                    D ** -0.5, False),
                                       sdpa_prefill.cudnn_attention(q, kd[ctx - chunk:], vd[ctx - chunk:],
                                                                    D ** -0.5, True)),
                              warmup=20, rep=300, return_mode="median")
        out = torch.empty_like(q)
        line = (f"  ctx {ctx // 1024}K chunk {chunk}: floor {floor:.2f} ms, today {today:.2f}, SDPA default "
                f"{peer:.2f}, cuDNN direct {peer_cudnn:.2f}")
        for piece in (16384, 32768, 65536, 131072):
            t = do_bench(lambda: sdpa_prefill.chunk_attention(q, kc, vc, ks, vs, bt[0], ctx, D ** -0.5, out, piece),
                         warmup=20, rep=300, return_mode="median")
            line += f", new(piece {piece // 1024}K) {t:.2f}"
        g = do_bench(lambda: sdpa_prefill.gather_kv(kc, vc, ks, vs, bt[0], 0, min(ctx, 65536),
                                                    torch.empty(65536, HKV, D, device=DEV, dtype=torch.bfloat16),
                                                    torch.empty(65536, HKV, D, device=DEV, dtype=torch.bfloat16)),
                     warmup=5, rep=100, return_mode="median")
        print(line + f"; gather of {min(ctx, 65536) // 1024}K keys {g:.3f} ms", flush=True)
        for L in (256, 1024, 2048):  # where the cuDNN path starts to win
            qL = q[:L]
            cuL = torch.tensor([0, L], dtype=torch.int32, device=DEV)
            a = do_bench(lambda: paged_attention_triton(qL, kc, vc, bt, cuL, sl, D ** -0.5, ks, vs, L, ctx),
                         warmup=10, rep=100, return_mode="median")
            b = do_bench(lambda: sdpa_prefill.chunk_attention(qL, kc, vc, ks, vs, bt[0], ctx, D ** -0.5, out[:L],
                                                              65536), warmup=10, rep=100, return_mode="median")
            print(f"    chunk {L} over {ctx // 1024}K: today {a:.3f} ms, new {b:.3f} ms", flush=True)
        del kc, vc, ks, vs, kd, vd
        torch.cuda.empty_cache()


def cold_shapes():
    """cuDNN builds an execution plan per new shape (torch caches it): the first call of each new (chunk, keys)
    shape against the second."""
    import time
    kc, vc, ks, vs, bt = _paged(40000, 1, DEV, torch.int8)
    for L, ctx in ((2000, 20000), (3000, 33000), (517, 9000), (8192, 39999), (1111, 12345)):
        q = torch.randn(L, HQ, D, device=DEV, dtype=torch.bfloat16)
        out = torch.empty_like(q)
        times = []
        for _ in range(2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            sdpa_prefill.chunk_attention(q, kc, vc, ks, vs, bt[0], ctx, D ** -0.5, out, 32768)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        print(f"  cold shape chunk {L} over {ctx}: first call {times[0]:.1f} ms, second {times[1]:.1f} ms", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="16,64,256,512,2048,8192")
    ap.add_argument("--only", default="gemm,attn")
    ap.add_argument("--configs", default="", help="comma list of GEMM config names to keep (default: all)")
    args = ap.parse_args()
    if args.configs:
        keep = set(args.configs.split(","))
        for table in (SMALL, MID, LARGE):
            for name in [c for c in table if c not in keep]:
                del table[name]
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    lim = ceilings()
    if "attn" in args.only or "check" in args.only:
        check_attention()
    if "attn" in args.only:
        sweep_attention(lim)
    if "cold" in args.only:
        cold_shapes()
    if "gemm" in args.only:
        sweep_gemm([int(r) for r in args.rows.split(",")], lim)


if __name__ == "__main__":
    main()
