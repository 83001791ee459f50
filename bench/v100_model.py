"""A V100 performance model of qv's sm70 kernels at the Qwen3.5-27B shapes, since no V100 can be measured
here: for each kernel of a decode step (MTP k = 3 verification, batch 1) and of a 250K prefill, its bytes,
FLOPs and m8n8k4 MMA count per GPU, its time at the V100's 900 GB/s and 125 TFLOP/s with the stated
efficiency, and the predicted totals. Two deployments: the original's (two V100s, tensor parallel 2,
GPTQ-Int8), beside its measured numbers, and one V100 with GPTQ-Int4 weights (issue 41: the 27B in 32 GB).

    python bench/v100_model.py [--json OUT]

Every efficiency below is an assumption, named and sourced: a V100 run replaces them with measurements.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from qv.model.tiny import PRESETS

COPY_BYTES_PER_S = 900e9  # V100 SXM2 HBM2
MMA_FLOPS_PER_S = 125e12  # fp16 tensor cores, fp32 accumulate
MMA_FLOPS = 2 * 8 * 8 * 4  # one mma.sync.m8n8k4 (a warp): 256 multiply-adds
K_DRAFTS = 3
ACCEPTANCE = 3.6  # the original's production mean at k = 3
# Efficiencies (fraction of the roofline a kernel reaches), each an assumption:
GEMV_EFF = 0.85  # GPTQ-Int8 GEMV at M <= 16: TurboMind's s884 GEMM ran flat in M at 93% of roofline (volta.md)
# 4-bit GEMV: the same MMAs and fp16 dequantization per code as 8-bit, plus the nibble masks, over half the
# bytes: twice the ALU work a byte, so a lower share of the bandwidth roofline (an assumption)
GEMV4_EFF = 0.70
ATTN_DECODE_EFF = 0.75  # split-K paged decode over int8 KV: bandwidth-bound, shorter streams than the GEMVs
STATE_EFF = 0.8  # GDN recurrent step: fp32 state read and written once, per-position states written
GEMM_EFF = 0.55  # prefill GPTQ GEMM (codes dequantized in registers, m8n8k4): below cuBLAS's ~0.8 on fp16
GEMM4_EFF = 0.52  # the same GEMM at 4 bits: its loader adds the nibble masks, the MMAs are the same
FMHA_EFF = 0.35  # causal FMHA prefill, head_dim 256, N32 score tiles (volta.md: N64 changed sampled tokens)
GDN_CHUNK_EFF = 0.3  # chunked GDN prefill on m8n8k4: small 64-token matmuls and a sequential scan
ALL_REDUCE_S = 7.2e-3 / 130  # the original measured 7.1-7.3 ms a step for its ~130 latency-bound all-reduces
PCIE_BYTES_PER_S = 12e9  # PCIe 3.0 x16 as a two-GPU ring moves it (each rank sends its half, then receives)
GRAPH_LAUNCH_S = 2.5e-6  # per small kernel replayed from a CUDA graph (norms, rope, gates, conv, ...)
SMALL_KERNELS = 600  # per decode step, from the H200 profile (docs/BENCHMARKS.md)
ORIGINAL_TOKENS_PER_S = {32768: 55.8, 131072: 58.4, 250000: 48.6}  # two V100s, MTP k = 3
ORIGINAL_PREFILL_250K_S = 186.8


@dataclass
class Part:
    kernel: str
    bytes: float
    flops: float
    mmas: float
    eff: float
    bound: str  # "bytes" | "flops" | "latency"
    latency_s: float = 0.0

    @property
    def seconds(self) -> float:
        if self.bound == "latency":
            return self.latency_s
        roof = self.bytes / COPY_BYTES_PER_S if self.bound == "bytes" else self.flops / MMA_FLOPS_PER_S
        return roof / self.eff


def shapes() -> dict:
    p = PRESETS["27b"]
    h, inter, vocab = p["hidden_size"], p["intermediate_size"], p["vocab_size"]
    q_out = 2 * p["num_attention_heads"] * p["head_dim"]  # queries and their output gate
    kv_out = 2 * p["num_key_value_heads"] * p["head_dim"]
    hk, hv, dk, dv = (p["linear_num_key_heads"], p["linear_num_value_heads"], p["linear_key_head_dim"],
                      p["linear_value_head_dim"])
    gdn_in = 2 * hk * dk + 2 * hv * dv + 2 * hv  # q, k, v, z, b, a
    mlp = 3 * h * inter
    attn_layer = h * (q_out + kv_out) + p["num_attention_heads"] * p["head_dim"] * h + mlp
    gdn_layer = h * gdn_in + hv * dv * h + mlp
    n = p["num_hidden_layers"]
    return dict(h=h, vocab=vocab, n_attn=n // 4, n_gdn=n - n // 4, attn_layer=attn_layer, gdn_layer=gdn_layer,
                kv_heads=p["num_key_value_heads"], q_heads=p["num_attention_heads"], head_dim=p["head_dim"],
                hv=hv, dk=dk, dv=dv, params=(n // 4) * attn_layer + (n - n // 4) * gdn_layer)


def decode_parts(context: int, tp: int = 2, bits: int = 8) -> list[Part]:
    """One speculative step per GPU: verification of k drafts (k + 1 rows) and the next k drafts."""
    s, m, TP = shapes(), K_DRAFTS + 1, tp
    codes = s["params"] / TP * (bits / 8 + 2 / 128)  # codes and one fp16 scale per group of 128
    gemv_eff = GEMV_EFF if bits == 8 else GEMV4_EFF
    mmas_gemv = s["params"] / TP / (8 * 4)  # weights on the MMA's 8-row side, k+1 <= 8 rows on its 8 columns
    kv_per_token = s["n_attn"] * (s["kv_heads"] // TP) * (2 * s["head_dim"] + 8)  # int8 K and V, fp32 scales
    q_rows = m * s["q_heads"] // s["kv_heads"]  # a KV head's query rows (GQA group x verification rows)
    attn_flops = 4 * context * s["head_dim"] * q_rows * s["n_attn"] * (s["kv_heads"] // TP)
    state = s["n_gdn"] * (s["hv"] // TP) * s["dk"] * s["dv"] * 4
    head = (s["attn_layer"] / TP + 2 * s["h"] * s["h"] / TP) * bits / 8  # the MTP layer and its fc, quantized
    ranking = s["vocab"] / TP * s["h"]  # the draft top-1's int8 copy of the lm_head
    parts = [
        Part(f"gptq_gemv_m884<BITS={bits}> (all linears, M = k+1)", codes, 2 * m * s["params"] / TP, mmas_gemv,
             gemv_eff, "bytes"),
        Part("lm_head (fp16" + (", vocabulary-parallel)" if TP > 1 else ")"), s["vocab"] / TP * s["h"] * 2, 2 * m * s["vocab"] / TP * s["h"],
             0, GEMV_EFF, "bytes"),
        Part(f"paged_decode_m884 ({context:,} tokens)", kv_per_token * context, attn_flops,
             attn_flops / MMA_FLOPS, ATTN_DECODE_EFF, "bytes"),
        Part("GDN recurrent step (fp32 state, k+1 positions kept)", state * (2 + m), 0, 0, STATE_EFF, "bytes"),
        Part("MTP drafts: head layer + int8 top-1, k times", K_DRAFTS * (head + ranking),
             2 * K_DRAFTS * (head + ranking), K_DRAFTS * (head + ranking) / (8 * 4), gemv_eff, "bytes"),
        Part("small kernels from the CUDA graph", 0, 0, 0, 1, "latency", SMALL_KERNELS * GRAPH_LAUNCH_S),
    ]
    if TP > 1:
        parts.append(Part("all-reduces (2 a layer, PCIe pair)", 0, 0, 0, 1, "latency", 130 * ALL_REDUCE_S))
    return parts


def prefill_parts(tokens: int, tp: int = 2, bits: int = 8) -> list[Part]:
    s, TP = shapes(), tp
    linear = 2 * tokens * s["params"] / TP
    hd, qh = s["head_dim"], s["q_heads"] // TP
    fmha = 2 * tokens * tokens * hd * qh * s["n_attn"]  # QK^T and PV, causal halves each: 2 * S^2 * d per head
    chunk = 64
    gdn = tokens * s["n_gdn"] * (s["hv"] // TP) * (6 * s["dk"] * s["dv"] + 4 * chunk * (s["dk"] + s["dv"]))
    parts = [
        Part(f"gptq_gemm_m884<BITS={bits}> (all linears)", s["params"] / TP * bits / 8, linear, linear / MMA_FLOPS,
             GEMM_EFF if bits == 8 else GEMM4_EFF, "flops"),
        Part("paged_prefill_m884 (causal FMHA, head_dim 256)", 0, fmha, fmha / MMA_FLOPS, FMHA_EFF, "flops"),
        Part("gdn_*_m884 (chunked GDN)", 0, gdn, gdn / MMA_FLOPS, GDN_CHUNK_EFF, "flops"),
    ]
    if TP > 1:
        parts.append(Part("all-reduces (2 a layer, PCIe pair)", 130 * tokens * s["h"] * 2, 0, 0, 1, "latency",
                          130 * tokens * s["h"] * 2 / PCIE_BYTES_PER_S))
    return parts


def _time(seconds: float) -> str:
    return f"{seconds:,.1f} s" if seconds >= 1 else f"{seconds * 1e3:,.2f} ms"


def table(title: str, parts: list[Part]) -> str:
    lines = [f"{title}", "", "| kernel | bytes/GPU | FLOPs/GPU | m8n8k4 MMAs | efficiency | time |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for p in parts:
        eff = "latency" if p.bound == "latency" else f"{p.eff:.2f} of {p.bound}"
        lines.append(f"| {p.kernel} | {p.bytes / 1e9:.2f} GB | {p.flops / 1e12:.2f} T | {p.mmas / 1e6:,.0f} M | "
                     f"{eff} | {_time(p.seconds)} |")
    lines.append(f"| **total** | | | | | **{_time(sum(p.seconds for p in parts))}** |")
    return "\n".join(lines)


DEPLOYMENTS = {"2x V100, TP 2, GPTQ-Int8": dict(tp=2, bits=8), "1x V100, GPTQ-Int4": dict(tp=1, bits=4)}


def predict(tp: int, bits: int) -> dict:
    """Predicted decode rate (tokens/s at the original's acceptance) per context and 250K prefill seconds."""
    decode = {}
    for context in ORIGINAL_TOKENS_PER_S:
        step = sum(p.seconds for p in decode_parts(context, tp, bits))
        decode[context] = {"step_s": step, "tokens_per_s": ACCEPTANCE / step}
    return {"decode": decode, "prefill_250k_s": sum(p.seconds for p in prefill_parts(250000, tp, bits))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    report = {name: predict(**d) for name, d in DEPLOYMENTS.items()}
    out = []
    for name, d in DEPLOYMENTS.items():
        out += [table(f"{name}: decode step at 32,768 tokens, batch 1, MTP k = {K_DRAFTS}, per GPU",
                      decode_parts(32768, **d)), ""]
        out += [table(f"{name}: 250K prefill, per GPU", prefill_parts(250000, **d)), ""]
    out += ["| context | " + " | ".join(f"{n} (predicted)" for n in DEPLOYMENTS) + " | original, 2x V100 (measured) |",
            "| ---: |" + " ---: |" * (len(DEPLOYMENTS) + 1)]
    for context, measured in ORIGINAL_TOKENS_PER_S.items():
        rates = " | ".join(f"{r['decode'][context]['tokens_per_s']:.0f} tok/s" for r in report.values())
        out.append(f"| {context:,} | {rates} | {measured} tok/s |")
    rates = " | ".join(f"{r['prefill_250k_s']:.0f} s" for r in report.values())
    out.append(f"| 250K prefill | {rates} | {ORIGINAL_PREFILL_250K_S} s |")
    print("\n".join(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
