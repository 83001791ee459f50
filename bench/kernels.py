"""Kernel benchmarks at Qwen3.5-27B layer shapes: ours vs a peer vs the hardware limit, in one run.

    python bench/kernels.py [--sweep all|attn,gdn,...] [--json out.json]

Every time is the median of many launches (triton.testing.do_bench, which also clears the L2
between launches); inputs that fit in L2 are rotated among enough copies to exceed 3x the L2.
Decode attention and the GEMV are also timed by CUDA-graph replay (do_bench_cudagraph over all
input sets): under ~100 us do_bench can include host launch time, and decode runs as graphs in
the engine, so their rows report the graph time (do_bench in the note).
Ceilings (copy bandwidth, bf16 matmul rate) are measured in the same run. --sweep also times
a few tile configurations of the named groups and reports the best (how the defaults were chosen).
FLA (flash-linear-attention) is imported if installed; its rows are skipped otherwise.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench, do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_profile import kernel_times  # noqa: E402
from kernel_inputs import GDN_INDEX_ARGS, attention_inputs, decode_inputs, gdn_inputs, gptq_inputs  # noqa: E402
from qv.kernels import cuda_build  # noqa: E402
from qv.kernels.gated_delta_rule.configs import SWEEP_CONFIGS as GDN_CHUNK_SWEEP  # noqa: E402
from qv.kernels.gated_delta_rule.triton import gated_delta_rule as gated_delta_rule_triton  # noqa: E402
from qv.kernels.gated_delta_rule.triton_prep import chunk_prep, chunk_prep_split  # noqa: E402
from qv.kernels.linear.reference import dequantize_gptq  # noqa: E402
from qv.kernels.linear.triton import linear as linear_triton  # noqa: E402
from qv.kernels.paged_attention.triton import paged_attention as paged_attention_triton  # noqa: E402
from qv.kernels.varlen_attention.triton import varlen_attention as varlen_attention_triton  # noqa: E402

DEV = torch.device("cuda")
L2_BYTES = 60 << 20
ROWS: list[dict] = []


cuda_build.EAGER_ALWAYS = True  # eager calls run the raw-CUDA kernels too (their GPU time is measured)


def median_ms(fn, rep_ms: int = 300) -> float:
    return do_bench(fn, warmup=50, rep=rep_ms, return_mode="median")


def rotating(make, nbytes: int, cap: int = 24):
    """Input sets cycled call by call, enough of them to exceed 3x the L2."""
    n = max(1, min(cap, math.ceil(3 * L2_BYTES / max(nbytes, 1))))
    sets = [make() for _ in range(n)]
    it = itertools.cycle(sets)
    return lambda: next(it), n


def row(group, case, ours_ms, peer_ms=None, peer="", limit=None, metric="", target="", met=None, note=""):
    r = dict(group=group, case=case, ours_ms=ours_ms, peer=peer, peer_ms=peer_ms, limit=limit, metric=metric,
             target=target, met=met, note=note)
    ROWS.append(r)
    peer_s = f"{peer} {peer_ms:.3f} ms" if peer_ms else "-"
    print(f"| {group} | {case} | {ours_ms:.3f} ms | {peer_s} | {limit or '-'} | {metric} | {target} | "
          f"{'yes' if met else ('no' if met is not None else '-')} | {note}", flush=True)


def graph_ms(fns) -> float | None:
    """One call's median time from CUDA-graph replays of fns (one per input set, so the sets rotate past
    the L2): CPU launch overhead excluded, as in the engine's decode graphs."""
    def run():
        for f in fns:
            f()
    try:
        run()
        torch.cuda.synchronize()
        return do_bench_cudagraph(run, rep=100, return_mode="median") / len(fns)
    except Exception as e:
        print(f"    graph timing failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
        return None


def kernel_breakdown(fn, reps: int = 5) -> tuple[float | None, str]:
    """GPU time per call of each kernel fn launches (torch.profiler), largest first: where a
    composite op's time goes, measured rather than guessed. Returns (total ms, text)."""
    from torch.profiler import ProfilerActivity, profile
    try:
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn()
            torch.cuda.synchronize()
    except Exception as e:
        return None, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    times = kernel_times(prof, reps)
    total = sum(ms for _, ms, _ in times)
    return total, f"{total:.3f} ms = " + " + ".join(f"{name[:60]} {ms:.3f}" for name, ms, _ in times)


def try_time(fn, rep_ms=150):
    try:
        fn()
        torch.cuda.synchronize()
        return median_ms(fn, rep_ms)
    except Exception as e:  # a config that does not compile (shared memory, registers) is reported
        print(f"    config failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
        return float("inf")


# ---------------------------------------------------------------------------------------------
# ceilings
# ---------------------------------------------------------------------------------------------


def ceilings() -> dict:
    a = torch.empty(2 << 30, dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    t = median_ms(lambda: b.copy_(a))
    copy_tbs = 2 * a.numel() / t / 1e9
    del a, b
    x = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    y = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    t = median_ms(lambda: x @ y)
    mm_tflops = 2 * 8192**3 / t / 1e9
    print(f"ceilings: copy {copy_tbs:.2f} TB/s (read + write), bf16 matmul {mm_tflops:.0f} TFLOP/s", flush=True)
    return dict(copy_tbs=copy_tbs, mm_tflops=mm_tflops)


# ---------------------------------------------------------------------------------------------
# cases
# ---------------------------------------------------------------------------------------------


def bench_prefill_attention(lim, sweep):
    configs = [None]
    if sweep:  # pages only (the path before k_new), TMA bulk copies of the new keys, other tiles
        configs += [dict(new_kv=False), dict(tma=True), dict(tma=True, BLOCK_N=32, num_stages=3),
                    dict(BLOCK_N=32, num_stages=3), dict(BLOCK_N=128, num_warps=8, num_stages=2),
                    dict(tma=True, BLOCK_N=128, num_stages=1)]
    for n in (8192, 32768):
        inp = attention_inputs(n, DEV)
        flops = 4 * n * n * 256 * 24 / 2
        best = (float("inf"), None)
        for cfg in (configs if n == 8192 else [best_cfg.get("attn")]):
            t = try_time(lambda: paged_attention_triton(*inp["paged"], config=cfg), 500)
            if sweep and n == 8192:
                print(f"    attn 8K {cfg}: {t:.3f} ms ({flops / t / 1e9:.0f} TFLOP/s)", flush=True)
            best = min(best, (t, cfg), key=lambda x: x[0])
        if n == 8192:
            best_cfg["attn"] = best[1]
        q, k, v = inp["sdpa"]
        try:
            t_sdpa = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), 500)
            note = "SDPA enable_gqa"
        except Exception:  # older SDPA without GQA: K/V expanded outside the timing
            ke, ve = k.repeat_interleave(6, 1), v.repeat_interleave(6, 1)
            t_sdpa = median_ms(lambda: F.scaled_dot_product_attention(q, ke, ve, is_causal=True), 500)
            note = "SDPA on expanded K/V"
        if sweep and n == 8192:
            attention_variants(inp, flops, best[1])
        t = best[0]
        row("prefill attn bf16 24q/4kv d256 causal", f"{n // 1024}K", t, t_sdpa, "SDPA",
            f"{lim['mm_tflops']:.0f} TFLOP/s", f"{flops / t / 1e9:.0f} vs {flops / t_sdpa / 1e9:.0f} TFLOP/s",
            ">= 0.9x SDPA", t_sdpa / t >= 0.9, f"{t_sdpa / t:.2f}x; {note}; cfg {best[1]}")
        del inp


def attention_variants(inp, flops, cfg):
    """Where the prefill-attention gap to SDPA comes from: our kernel on contiguous (unpaged) K/V,
    without the causal mask, at head_dim 128, and each SDPA backend on its own (which one the
    default picks, and how a flash-attention-2 class kernel compares)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, kc, vc, bt, cu, sl, scale = inp["paged"][:7]
    n = q.shape[0]
    qs, ks, vs = inp["sdpa"]
    k_dense, v_dense = ks[0].transpose(0, 1).contiguous(), vs[0].transpose(0, 1).contiguous()  # [n, 4, 256]
    report = lambda name, t, fl=flops: print(f"    attn 8K {name}: {t:.3f} ms ({fl / t / 1e9:.0f} TFLOP/s)",  # noqa: E731
                                             flush=True)
    report("ours, contiguous K/V (varlen path)", try_time(lambda: varlen_attention_triton(
        q, k_dense, v_dense, cu, scale, causal=True, max_seqlen=n, config=cfg), 500))
    report("ours, not causal (all keys)", try_time(lambda: varlen_attention_triton(
        q, k_dense, v_dense, cu, scale, causal=False, max_seqlen=n, config=cfg), 500), 2 * flops)
    q128, k128, v128 = q[..., :128].contiguous(), k_dense[..., :128].contiguous(), v_dense[..., :128].contiguous()
    report("ours, head_dim 128", try_time(lambda: varlen_attention_triton(
        q128, k128, v128, cu, scale, causal=True, max_seqlen=n), 500), flops / 2)
    qs128, ks128, vs128 = (x[..., :128].contiguous() for x in (qs, ks, vs))
    ke, ve = ks.repeat_interleave(6, 1), vs.repeat_interleave(6, 1)
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        with sdpa_kernel([backend]):
            report(f"SDPA {backend.name} (K/V expanded to 24 heads)", try_time(lambda: F.scaled_dot_product_attention(
                qs, ke, ve, is_causal=True), 500))
    report("SDPA default, head_dim 128", try_time(lambda: F.scaled_dot_product_attention(
        qs128, ks128, vs128, is_causal=True, enable_gqa=True), 500), flops / 2)


def bench_gdn_chunk(lim, sweep, fla):
    configs = [None] + (GDN_CHUNK_SWEEP if sweep else [])
    for n in (8192, 32768):
        inp = gdn_inputs(n, 1, DEV, torch.bfloat16)
        best = (float("inf"), None)
        for cfg in (configs if n == 8192 else [best_cfg.get("gdn")]):
            t = try_time(lambda: gated_delta_rule_triton(*inp["ours"], max_query_len=n, config=cfg))
            if sweep and n == 8192:
                _, text = kernel_breakdown(lambda: gated_delta_rule_triton(*inp["ours"], max_query_len=n, config=cfg))
                print(f"    gdn chunk 8K {cfg}: {t:.3f} ms; {text}", flush=True)
            best = min(best, (t, cfg), key=lambda x: x[0])
        if n == 8192:
            best_cfg["gdn"] = best[1]
        ik = inp["ours"]
        t_prep = median_ms(lambda: chunk_prep(ik[1], ik[2], ik[3], ik[4], ik[5], ik[6], ik[8], 48))
        t_split = median_ms(lambda: chunk_prep_split(ik[1], ik[2], ik[3], ik[4], ik[5], ik[6], ik[8], 48))
        print(f"    gdn chunk {n // 1024}K: prep alone: split (the default) {t_split:.3f} ms, fused (prep=fused) "
              f"{t_prep:.3f} ms", flush=True)
        gpu_ours, text = kernel_breakdown(lambda: gated_delta_rule_triton(*inp["ours"], max_query_len=n,
                                                                           config=best[1]))
        print(f"    gdn chunk {n // 1024}K ours by kernel: {text}", flush=True)
        t_fla, gpu_fla, note = None, None, "fla not installed"
        if fla is not None:
            t_fla, note = fla_chunk_time(fla, inp)
            gpu_fla, text = kernel_breakdown(fla_chunk_call(fla, inp))
            print(f"    gdn chunk {n // 1024}K FLA by kernel: {text}", flush=True)
        t = best[0]
        # FLA launches ~9 kernels from Python: at 8K its wall time can be host-bound (1.5 ms against
        # 0.72 ms of GPU work), so the ratio compares GPU time (sum of each side's kernels)
        ratio = gpu_fla / gpu_ours if gpu_fla and gpu_ours else None
        row("GDN chunked prefill bf16 16k/48v d128", f"{n // 1024}K", t, t_fla, "FLA chunk (wall)", "-",
            f"GPU time {gpu_ours or 0:.3f} vs {gpu_fla or 0:.3f} ms = {ratio:.2f}x FLA" if ratio else "-",
            ">= 1.0x FLA", None if ratio is None else ratio >= 1.0, f"{note}; cfg {best[1]}")
        del inp


def fla_chunk_call(fla, inp):
    q, k, v, a, b, A_log, dt_bias, _ = inp["fla"]
    return lambda: fla.chunk_gated_delta_rule(
        q, k, v, a, b, initial_state=None, output_final_state=True, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True)


def fla_chunk_time(fla, inp):
    q, k, v, a, b, A_log, dt_bias, _ = inp["fla"]
    try:
        fn = fla_chunk_call(fla, inp)
        fn()
        return median_ms(fn), "FLA with fused gate/beta/l2norm"
    except Exception as e:
        print(f"    FLA fused-gate call failed ({e}); precomputed g/beta instead", flush=True)
        g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
        beta = b.float().sigmoid().to(b.dtype)
        fn = lambda: fla.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True,  # noqa: E731
                                                use_qk_l2norm_in_kernel=True)
        return median_ms(fn), "FLA (g, beta precomputed, untimed)"


def bench_gdn_step(lim, sweep, fla):
    for batch in (1, 32):
        for state in (torch.float32, torch.int16):
            make = lambda: gdn_inputs(1, batch, DEV, torch.bfloat16, state_dtype=state)  # noqa: E731
            state_bytes = batch * 48 * 128 * 128 * (4 if state == torch.float32 else 2)
            nxt, n_sets = rotating(make, 2 * state_bytes)
            cfgs = [None] + (GDN_STEP_SWEEP if sweep else [])
            # decode steps run as CUDA graphs in the engine; do_bench at ~10 us measures host launches
            sets = share_index_tensors([nxt() for _ in range(n_sets)])
            best = (float("inf"), None, None)
            for cfg in cfgs:
                t_dob = try_time(lambda: gated_delta_rule_triton(*nxt()["ours"], max_query_len=1, config=cfg))
                tg = graph_ms([lambda i=i: gated_delta_rule_triton(*i["ours"], max_query_len=1, config=cfg)
                               for i in sets]) if t_dob < 1e9 else None
                if sweep:
                    print(f"    gdn step b{batch} {state} {cfg}: graph {tg * 1e3 if tg else float('nan'):.1f} us, "
                          f"do_bench {t_dob * 1e3:.1f} us", flush=True)
                best = min(best, (tg or t_dob, cfg, t_dob), key=lambda x: x[0])
            t, _, t_dob = best
            t_fla, note = None, "fla not installed"
            if fla is not None and state == torch.float32:
                t_fla, note = fla_step_time(fla, sets)
            note += f"; do_bench ours {t_dob * 1e3:.1f} us"
            hbm = 2 * state_bytes / (t * 1e-3) / 1e12
            row("GDN recurrent step bf16 48v d128", f"batch {batch}, {str(state)[6:]} state", t, t_fla,
                "FLA fused_recurrent", f"{lim['copy_tbs']:.2f} TB/s",
                f"{t * 1e3:.1f} us; state r+w {hbm:.2f} TB/s", "<= FLA time" if t_fla else "",
                (t <= t_fla) if t_fla else None, f"{note}; {n_sets} input sets; cfg {best[1]}")


def share_index_tensors(sets):
    """The input sets with the first set's cu_seqlens, slots and has_initial_state: the states, q, k, v, a
    and b rotate past the L2, but the engine's decode graph reads one static buffer of these in all of a
    step's GDN layers (48 at 27B), so only the first layer finds them outside the L2."""
    def with_shared(args):
        args = list(args)
        args[GDN_INDEX_ARGS] = sets[0]["ours"][GDN_INDEX_ARGS]
        return tuple(args)
    return [dict(s, ours=with_shared(s["ours"])) for s in sets]


def fla_step_call(fla, inp):
    """FLA's fused recurrent step on one input set, gate, beta and l2norm fused as in ours."""
    q, k, v, a, b, A_log, dt_bias, h0 = inp["fla"]
    return fla.fused_recurrent_gated_delta_rule(
        q, k, v, a, beta=b, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True)


def fla_step_time(fla, sets):
    """FLA's fused recurrent step, graph-replayed over the same input sets as ours."""
    try:
        fla_step_call(fla, sets[0])
        t = graph_ms([lambda i=i: fla_step_call(fla, i) for i in sets])
        if t is None:
            return None, "FLA not graph-capturable"
        return t, "FLA with fused gate/beta/l2norm (graph replay)"
    except Exception as e:
        print(f"    FLA fused_recurrent failed: {e}", flush=True)
        return None, "FLA call failed"


# decode variants over the default (the raw-CUDA kernel on sm_90: paged_attention/cuda_sm90.py): "split" is the
# Triton split-K kernel (always timed, as the previous kernel), whose stages pipeline K/V through
# cp.async (maxnreg=168 keeps 3 programs per SM) and waves trade split count against per-program
# prologue/epilogue; the CUDA kernel's min_blocks is its register cap, waves its rounds of blocks
OLD_DECODE = dict(kind="split")
DECODE_SWEEP = [dict(kind="cuda", min_blocks=1), dict(kind="cuda", waves=2), dict(kind="cuda", reduce_block_d=16),
                dict(kind="split", stages=0, waves=6)] + [dict(kind="cuda", splits=s) for s in (32, 48)]


def bench_decode(lim, sweep):
    # q_len 4: the speculative rows of MTP k = 3 (24 query rows a KV head; the target is the decode one's)
    for ctx, batch, q_len in ((32768, 1, 1), (32768, 16, 1), (131072, 1, 1), (131072, 16, 1), (32768, 1, 4),
                              (32768, 16, 4)):
        n_sets = 3 if ctx * batch <= 32768 else 1  # 68 MB per set: rotate three past the 60 MB L2
        sets = [decode_inputs(ctx, batch, DEV, q_len) for _ in range(n_sets)]
        inp = sets[0]
        nbytes = batch * ctx * 4 * (2 * 256 + 2 * 4)  # int8 K and V rows + their fp32 scales
        cfgs = [None, OLD_DECODE] + (DECODE_SWEEP if sweep and batch == 1 and q_len == 1 else [])
        times = {}
        for cfg in cfgs:
            t = try_time(lambda: paged_attention_triton(*inp, config=cfg), 200)
            tg = graph_ms([lambda i=i: paged_attention_triton(*i, config=cfg) for i in sets]) if t < 1e9 else None
            times[repr(cfg)] = (tg or t, t)
            print(f"    decode {ctx} b{batch} q{q_len} {cfg}: {t * 1e3:.1f} us ({nbytes / t / 1e9:.2f} TB/s); graph "
                  f"{tg * 1e3 if tg else float('nan'):.1f} us ({nbytes / tg / 1e9 if tg else 0:.2f} TB/s)", flush=True)
        tg, t = times[repr(None)]
        old = times[repr(OLD_DECODE)][0]
        if batch == 1 and q_len == 1:  # where the time goes (decode and split-merge kernels), by torch.profiler
            print(f"    decode {ctx} b1 kernels: {kernel_breakdown(lambda: paged_attention_triton(*inp))[1]}",
                  flush=True)
        tbs = nbytes / (tg * 1e-3) / 1e12
        pct = tbs / lim["copy_tbs"]
        case = f"ctx {ctx // 1024}K, batch {batch}" + (f", {q_len} query tokens" if q_len > 1 else "")
        row("paged decode int8 KV 24q/4kv d256", case, tg, None, "",
            f"{lim['copy_tbs']:.2f} TB/s", f"{tbs:.2f} TB/s = {100 * pct:.0f}% of copy (graph replay)", ">= 70%",
            pct >= 0.7, f"{nbytes / 1e6:.0f} MB read; do_bench {t * 1e3:.1f} us; old (Triton split-K) "
            f"{old * 1e3:.1f} us = {100 * nbytes / (old * 1e-3) / 1e12 / lim['copy_tbs']:.0f}%")
        del inp, sets


# kinds: "cuda" (the default on sm_90: linear/cuda_sm90.py), "mma" (its Triton twin), "fma" (CUDA cores),
# "dot" (x on the wide side of the MMA)
GEMV_SWEEP = [dict(kind="dot"), dict(kind="fma"), dict(kind="mma"),
              dict(kind="mma", BLOCK_N=64, BLOCK_K=128, waves=8)] + [
    dict(kind="cuda", waves=wv, min_blocks=mb, wk=wk) for wv, mb, wk in ((1, 3, 1), (2, 3, 4), (1, 4, 4), (1, 2, 4))]
GDN_STEP_SWEEP = [dict(bv=16, warps=1), dict(bv=16, warps=2), dict(bv=32, warps=2), dict(bv=32, warps=4),
                  dict(bv=64, warps=4), dict(bv=128, warps=8)]
GEMM_SWEEP = [dict(kind="dot", dequant_min_m=1 << 30, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=st,
                   GROUP_M=8) for bm, bn, bk, nw, st in ((128, 128, 64, 8, 4), (128, 256, 64, 8, 3))]


def bench_gemv(lim, sweep):
    for k, n in ((5120, 34816), (17408, 5120)):
        for m in (1, 4):
            sets = [gptq_inputs(k, n, m, DEV) for _ in range(1 if k * n > 120e6 else 2)]
            w, x = sets[0]
            nbytes = k * n + w.scales.numel() * 2 + x.numel() * 2 + m * n * 2
            cfgs = [None] + (GEMV_SWEEP if sweep else []) + (
                [dict(kind="cuda", splits=s) for s in (5, 7, 8, 12, 17)] if sweep and k == 17408 else [])
            best, default = (float("inf"), None, None), None
            wd = dequantize_gptq(w).to(torch.float16)
            xh = x.to(torch.float16)
            y_ref = F.linear(xh, wd).float()
            for cfg in cfgs:
                t = try_time(lambda: linear_triton(x, w, config=cfg))
                tg = graph_ms([lambda s=s: linear_triton(s[1], s[0], config=cfg) for s in sets]) if t < 1e9 else None
                if sweep and t < 1e9:
                    err = ((linear_triton(x, w, config=cfg).float() - y_ref).abs().max() / y_ref.abs().max()).item()
                    print(f"    gemv {k}->{n} m{m} {cfg}: {t * 1e3:.1f} us ({nbytes / t / 1e9:.2f} TB/s); graph "
                          f"{tg * 1e3 if tg else float('nan'):.1f} us ({nbytes / tg / 1e9 if tg else 0:.2f} TB/s); "
                          f"max err vs cuBLAS {err:.1e}", flush=True)
                best = min(best, (tg or t, cfg, t), key=lambda x_: x_[0])
                default = default or (tg or t, t)
            (tg, t), cfg = default, best[1]  # the row: the default; the note: the sweep's fastest
            t_peer = graph_ms([lambda: F.linear(xh, wd)]) or median_ms(lambda: F.linear(xh, wd))
            tbs = nbytes / (tg * 1e-3) / 1e12
            pct = tbs / lim["copy_tbs"]
            row("GPTQ-int8 GEMV fp16", f"{k}->{n}, M={m}", tg, t_peer, "fp16 GEMV (2 B/weight)",
                f"{lim['copy_tbs']:.2f} TB/s", f"{tbs:.2f} TB/s = {100 * pct:.0f}% of copy (graph replay)", ">= 75%",
                pct >= 0.75, f"do_bench {t * 1e3:.1f} us; fastest {cfg or 'default'} {best[0] * 1e3:.1f} us")
            del w, x, wd, sets


def bench_gemm(lim, sweep):
    for k, n in ((5120, 34816), (17408, 5120)):
        w, x = gptq_inputs(k, n, 8192, DEV)
        flops = 2 * 8192 * k * n
        cfgs = [None] + (GEMM_SWEEP if sweep and k == 5120 else [])
        best = (float("inf"), None)
        for cfg in cfgs:
            t = try_time(lambda: linear_triton(x, w, config=cfg), 500)
            if sweep:
                print(f"    gemm {k}->{n} {cfg}: {t:.3f} ms ({flops / t / 1e9:.0f} TFLOP/s)", flush=True)
            best = min(best, (t, cfg), key=lambda x_: x_[0])
        t = best[0]
        wd = dequantize_gptq(w).to(torch.float16)
        t_peer = median_ms(lambda: F.linear(x, wd), 500)
        row("GPTQ-int8 GEMM fp16", f"{k}->{n}, M=8192", t, t_peer, "fp16 matmul on dequantized W",
            f"{lim['mm_tflops']:.0f} TFLOP/s (bf16)", f"{flops / t / 1e9:.0f} vs {flops / t_peer / 1e9:.0f} TFLOP/s",
            ">= 0.8x peer", t_peer / t >= 0.8, f"{t_peer / t:.2f}x; cfg {best[1]}")
        del w, x, wd


best_cfg: dict = {}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", default="", help="groups (attn,gdn,step,decode,gemv,gemm) that also time a few "
                    "tile configurations; 'all' for every group")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--only", default="", help="comma list: attn,gdn,step,decode,gemv,gemm")
    args = ap.parse_args()
    try:
        import fla.ops.gated_delta_rule as fla
    except ImportError:
        fla = None
    import triton

    print(f"GPU {torch.cuda.get_device_name()}; torch {torch.__version__}; triton {triton.__version__}; "
          f"fla {getattr(sys.modules.get('fla'), '__version__', 'absent')}", flush=True)
    lim = ceilings()
    print("| group | case | ours | peer | limit | measure | target | met | note |")
    print("|---|---|---|---|---|---|---|---|---|")
    only = set(filter(None, args.only.split(",")))
    sw = set(args.sweep.split(","))
    on = lambda g: "all" in sw or g in sw  # noqa: E731
    steps = dict(attn=lambda: bench_prefill_attention(lim, on("attn")),
                 gdn=lambda: bench_gdn_chunk(lim, on("gdn"), fla),
                 step=lambda: bench_gdn_step(lim, on("step"), fla),
                 decode=lambda: bench_decode(lim, on("decode")),
                 gemv=lambda: bench_gemv(lim, on("gemv")),
                 gemm=lambda: bench_gemm(lim, on("gemm")))
    for name, fn in steps.items():
        if not only or name in only:
            try:
                fn()
            except Exception as e:  # one broken case must not hide the others
                print(f"{name}: FAILED {type(e).__name__}: {e}", flush=True)
            torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(dict(limits=lim, rows=ROWS, best=best_cfg), indent=1, default=str))


if __name__ == "__main__":
    main()
