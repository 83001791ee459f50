"""The benchmark cases of bench/kernels.py (and their peers) once each, for Nsight Compute.

    ncu --profile-from-start off --set full -o prof python3 bench/ncu_kernels.py [--only decode,gemv]

Every case runs twice unprofiled (compilation, autotuning), then once between
cudaProfilerStart/Stop, so ncu sees exactly one call of each. A line `CASE name` precedes each
profiled call: ncu's own `==PROF== Profiling "kernel"` lines follow it in the same log, which is
how bench/ncu_summary.py names the kernels of each case.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernel_inputs import attention_inputs, decode_inputs, gdn_inputs, gptq_inputs  # noqa: E402
from kernels import fla_chunk_call, fla_step_call  # noqa: E402
from qv.kernels import cuda_build  # noqa: E402
from qv.kernels.gated_delta_rule.triton import gated_delta_rule as gated_delta_rule_triton  # noqa: E402
from qv.kernels.linear.reference import dequantize_gptq  # noqa: E402
from qv.kernels.linear.triton import linear as linear_triton  # noqa: E402
from qv.kernels.paged_attention.triton import paged_attention as paged_attention_triton  # noqa: E402

DEV = torch.device("cuda")


cuda_build.EAGER_ALWAYS = True  # eager calls run the raw-CUDA kernels too (their GPU time is measured)


def decode_cases():
    for ctx, batch in ((32768, 1), (32768, 16), (131072, 1)):
        inp = decode_inputs(ctx, batch, DEV)
        yield f"decode ctx{ctx // 1024}K b{batch}", lambda inp=inp: paged_attention_triton(*inp)


def gemv_cases():
    for k, n in ((5120, 34816), (17408, 5120)):
        for m in (1, 4):
            w, x = gptq_inputs(k, n, m, DEV)
            yield f"gemv {k}->{n} M={m}", lambda x=x, w=w: linear_triton(x, w)
            if m == 4:
                wd = dequantize_gptq(w).half()
                yield f"cublas fp16 {k}->{n} M={m}", lambda x=x, wd=wd: F.linear(x, wd)


def gdn_cases(fla):
    inp = gdn_inputs(8192, 1, DEV, torch.bfloat16)
    yield "gdn chunk 8K ours", lambda: gated_delta_rule_triton(*inp["ours"], max_query_len=8192)
    if fla is not None:
        yield "gdn chunk 8K fla", fla_chunk_call(fla, inp)


def step_cases(fla):
    for batch in (1, 32):
        inp = gdn_inputs(1, batch, DEV, torch.bfloat16)
        yield f"gdn step b{batch} ours", lambda inp=inp: gated_delta_rule_triton(*inp["ours"], max_query_len=1)
        if fla is not None:
            yield f"gdn step b{batch} fla", lambda inp=inp: fla_step_call(fla, inp)


def attn_cases():
    inp = attention_inputs(8192, DEV)
    yield "attn 8K ours", lambda: paged_attention_triton(*inp["paged"])
    q, k, v = inp["sdpa"]
    yield "attn 8K sdpa", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="decode,gemv,gdn,step,attn")
    args = ap.parse_args()
    try:
        import fla.ops.gated_delta_rule as fla
    except ImportError:
        fla = None
    groups = dict(decode=decode_cases, gemv=gemv_cases, gdn=lambda: gdn_cases(fla), step=lambda: step_cases(fla),
                  attn=attn_cases)
    for name in args.only.split(","):
        for case, fn in groups[name]():
            fn()
            fn()
            torch.cuda.synchronize()
            print(f"CASE {case}", flush=True)
            torch.cuda.profiler.start()
            fn()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
