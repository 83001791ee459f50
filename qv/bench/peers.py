"""`qv bench --linears` and `--attention`: qv's two prefill kernels beside their peers and the hardware
floors, measured in one run at the model's own shapes.

- linears: every GPTQ-Int8 linear of a decoder layer (GDN in/out projections, attention QKV, MLP gate/up
  and down) at M rows, beside qv's block-FP8 linear (128x128 blocks, Qwen's FP8 layout) and cuBLAS on dense
  bf16 weights of the same shape (twice the bytes), and the int8 weight-read floor (codes + scales over the
  measured copy rate); per M, the sums over the five.
- attention: one prompt chunk attending to a cached prefix over the int8 paged cache, beside torch's SDPA on
  bf16 contiguous keys (the prefix without a mask, the chunk's own keys causally: two calls) and the FLOP
  floor (over the measured matmul rate).

On the GPU each time is the median of CUDA-graph replays (up to 512 rows, as decode steps run) or of
event-timed calls; on the CPU (CI) the shapes shrink and the times are wall-clock medians: the tables'
completeness is what is checked there, not their numbers.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from qv import kernels as K
from qv.bench.floors import Ceilings
from qv.model_config import ModelConfig

LINEAR_ROWS = (1, 16, 64, 256, 512, 2048, 8192)
ATTENTION_CONTEXTS = (32768, 131072)
ATTENTION_CHUNK = 8192
GROUP = 128
# on the CPU (the reference kernels): fewer rows and a short prefix, so CI checks the tables in seconds
CPU_LINEAR_ROWS, CPU_ATTENTION_CONTEXTS, CPU_ATTENTION_CHUNK = (1, 16, 64), (96, 160), 32


def layer_linears(cfg: ModelConfig) -> list[tuple[str, int, int]]:
    """(name, K, N) of the five GPTQ linears of the model's layers (27B: 5120 -> 16384, 6144 -> 5120, ...)."""
    h = cfg.hidden_size
    q_out = cfg.num_attention_heads * cfg.head_dim * (2 if cfg.attn_output_gate else 1)
    kv_out = 2 * cfg.num_key_value_heads * cfg.head_dim
    return [("gdn in_proj (qkvz)", h, 2 * cfg.linear_key_dim + 2 * cfg.linear_value_dim),
            ("gdn out_proj", cfg.linear_value_dim, h),
            ("attn qkv", h, q_out + kv_out),
            ("mlp gate_up", h, 2 * cfg.intermediate_size),
            ("mlp down", cfg.intermediate_size, h)]


def _median_ms(fn, device, graphs: bool) -> float:
    fn()
    if device.type != "cuda":
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    from triton.testing import do_bench, do_bench_cudagraph

    torch.cuda.synchronize(device)
    if graphs:
        return do_bench_cudagraph(fn, rep=50, return_mode="median")
    return do_bench(fn, warmup=10, rep=100, return_mode="median")


def _gptq(k: int, n: int, device, dtype):
    from qv.kernels.linear import GPTQWeight

    groups = -(-k // GROUP)
    return GPTQWeight(torch.randint(0, 256, (k, n), dtype=torch.uint8, device=device),
                      (torch.rand(groups, n, device=device) * 0.002 + 1e-4).to(dtype), None,
                      torch.arange(k, dtype=torch.int32, device=device) // GROUP, GROUP)


def _fp8(k: int, n: int, device):
    from qv.kernels.linear import FP8Weight

    weight = torch.randn(n, k, device=device).to(torch.float8_e4m3fn)
    return FP8Weight(weight, torch.rand(-(-n // GROUP), -(-k // GROUP), device=device) * 1e-3 + 1e-4, (GROUP, GROUP))


def linear_table(cfg: ModelConfig, device, dtype, ceilings: Ceilings, rows=None) -> list[dict]:
    """One record per (linear, M) and one per M summing the five ("linear": "sum")."""
    rows = rows or (LINEAR_ROWS if device.type == "cuda" else CPU_LINEAR_ROWS)
    records = []
    for m in rows:
        total = dict(linear="sum", m=m, qv_ms=0.0, fp8_ms=0.0, cublas_ms=0.0, floor_ms=0.0)
        for name, k, n in layer_linears(cfg):
            w, w8 = _gptq(k, n, device, dtype), _fp8(k, n, device)
            dense = torch.randn(n, k, device=device, dtype=dtype)
            x = torch.randn(m, k, device=device, dtype=dtype)
            graphs = device.type == "cuda" and m <= 512
            rec = dict(linear=name, m=m, k=k, n=n,
                       qv_ms=_median_ms(lambda: K.linear(x, w), device, graphs),
                       fp8_ms=_median_ms(lambda: K.linear(x, w8), device, graphs),
                       cublas_ms=_median_ms(lambda: F.linear(x, dense), device, graphs),
                       floor_ms=(k * n + w.scales.numel() * w.scales.element_size())
                       / ceilings.copy_bytes_per_s * 1e3)
            records.append(rec)
            for key in ("qv_ms", "fp8_ms", "cublas_ms", "floor_ms"):
                total[key] += rec[key]
            del w, w8, dense, x
        records.append(total)
    return records


def attention_table(cfg: ModelConfig, device, dtype, ceilings: Ceilings, contexts=None, chunk=None,
                    block_size=16) -> list[dict]:
    """One record per context: the chunk's last `chunk` rows over `context` keys (prefix + itself)."""
    cuda = device.type == "cuda"
    contexts = contexts or (ATTENTION_CONTEXTS if cuda else CPU_ATTENTION_CONTEXTS)
    chunk = chunk or (ATTENTION_CHUNK if cuda else CPU_ATTENTION_CHUNK)
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    records = []
    for ctx in contexts:
        blocks = -(-ctx // block_size)
        shape = (blocks + 1, block_size, hkv, d)
        kc = torch.randint(-127, 128, shape, dtype=torch.int8, device=device)
        vc = torch.randint(-127, 128, shape, dtype=torch.int8, device=device)
        ks = torch.rand(shape[:3], device=device) * 0.02
        vs = torch.rand(shape[:3], device=device) * 0.02
        table = torch.randperm(blocks + 1, device=device)[:blocks].to(torch.int32)[None]
        q = torch.randn(chunk, hq, d, device=device, dtype=dtype)
        cu = torch.tensor([0, chunk], dtype=torch.int32, device=device)
        lens = torch.tensor([ctx], dtype=torch.int32, device=device)
        qv_ms = _median_ms(lambda: K.paged_attention(q, kc, vc, table, cu, lens, d ** -0.5, ks, vs, chunk, ctx),
                           device, False)
        keys = torch.randn(ctx, hkv, d, device=device, dtype=dtype).transpose(0, 1)[None]
        values = torch.randn(ctx, hkv, d, device=device, dtype=dtype).transpose(0, 1)[None]
        qs = q.transpose(0, 1)[None]
        prefix = ctx - chunk

        def sdpa():
            F.scaled_dot_product_attention(qs, keys[:, :, :prefix], values[:, :, :prefix], enable_gqa=True)
            F.scaled_dot_product_attention(qs, keys[:, :, prefix:], values[:, :, prefix:], is_causal=True,
                                           enable_gqa=True)

        flops = 4 * chunk * hq * d * (prefix + chunk / 2)
        records.append(dict(context=ctx, chunk=chunk, qv_ms=qv_ms, sdpa_ms=_median_ms(sdpa, device, False),
                            floor_ms=flops / ceilings.matmul_flops_per_s * 1e3))
        del kc, vc, ks, vs, keys, values
    return records


def linear_markdown(records: list[dict]) -> str:
    lines = ["| linear | M | qv GPTQ-Int8 ms | qv FP8 ms | cuBLAS bf16 ms | weight-read floor ms | qv / cuBLAS | "
             "FP8 / cuBLAS | qv / floor |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in records:
        name = f"**{r['linear']}**" if r["linear"] == "sum" else r["linear"]
        lines.append(f"| {name} | {r['m']} | {r['qv_ms']:.3f} | {r['fp8_ms']:.3f} | {r['cublas_ms']:.3f} | "
                     f"{r['floor_ms']:.3f} | {r['qv_ms'] / r['cublas_ms']:.2f} | {r['fp8_ms'] / r['cublas_ms']:.2f} | "
                     f"{r['qv_ms'] / r['floor_ms']:.2f} |")
    return "\n".join(lines)


def attention_markdown(records: list[dict]) -> str:
    lines = ["| context | chunk | qv paged_attention (int8 pages) ms | SDPA bf16 ms | FLOP floor ms | qv / SDPA |",
             "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in records:
        lines.append(f"| {r['context']} | {r['chunk']} | {r['qv_ms']:.2f} | {r['sdpa_ms']:.2f} | {r['floor_ms']:.2f} | "
                     f"{r['qv_ms'] / r['sdpa_ms']:.2f} |")
    return "\n".join(lines)
