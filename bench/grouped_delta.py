"""The grouped low-rank delta launch (qv/kernels/grouped_delta) at the 27B linears: Clef's slot (LoRA rank
256 + deabl rank 1 on every member) and LoRA adapter slots, at a prompt chunk's rows and at decode rows,
beside the bf16 GEMM of the same linear and the deltas' own FLOP and byte floors measured in the same
run. Says what a Clef or adapter row costs over its base GEMM (issue 33: rows cost their FLOPs).

    python bench/grouped_delta.py [--rows 8,64,256,2048] [--adapters 0,3]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import ceilings, graph_ms  # noqa: E402
from qv import kernels as K  # noqa: E402
from qv.kernels.grouped_delta import DeltaGroups  # noqa: E402
from qv.model.delta_bank import DeltaBank  # noqa: E402

DEV = torch.device("cuda")
# (name, K, member widths) of the 27B decoder's fused linears
SHAPES = (("gdn in_proj_qkvz", 5120, [10240, 6144]), ("gdn out_proj", 6144, [5120]),
          ("attn qkv", 5120, [12288, 1024, 1024]), ("mlp gate_up", 5120, [17408, 17408]), ("mlp down", 17408, [5120]))
CLEF_RANKS = (256, 1)
ADAPTER_RANK = 64


def bank_for(k: int, members: list[int], adapters: int) -> DeltaBank:
    n = sum(members)
    clef_rows = sum(CLEF_RANKS) * len(members)
    bank = DeltaBank(k, members, [clef_rows] + [ADAPTER_RANK * len(members)] * adapters,
                     [sum(CLEF_RANKS) * n] + [ADAPTER_RANK * n] * adapters, torch.bfloat16, DEV)
    rnd = lambda *s: torch.randn(*s, device=DEV, dtype=torch.bfloat16) * 0.02  # noqa: E731
    bank.write(0, [(m, rnd(r, k), rnd(w, r), 1.0) for r in CLEF_RANKS for m, w in enumerate(members)])
    for s in range(1, adapters + 1):
        bank.write(s, [(m, rnd(ADAPTER_RANK, k), rnd(w, ADAPTER_RANK), 2.0) for m, w in enumerate(members)])
    return bank


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="8,64,256,2048", help="rows per slot (64: a mixed step's records under a target)")
    ap.add_argument("--adapters", default="0,3", help="LoRA adapter slots beside Clef's, each with --rows rows")
    args = ap.parse_args()
    c = ceilings()
    print(f"{'linear':18} {'slots':>5} {'rows':>6} {'GEMM ms':>8} {'delta ms':>8} {'delta/GEMM':>10} "
          f"{'delta floor ms':>14}", flush=True)
    for name, k, members in SHAPES:
        n = sum(members)
        w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16)
        for adapters in map(int, args.adapters.split(",")):
            bank = bank_for(k, members, adapters)
            slots = adapters + 1
            for rows in map(int, args.rows.split(",")):
                t = rows * slots
                x = torch.randn(t, k, device=DEV, dtype=torch.bfloat16)
                y = torch.empty(t, n, device=DEV, dtype=torch.bfloat16)
                g = DeltaGroups(torch.arange(t, device=DEV),
                                torch.arange(0, t + 1, rows, device=DEV, dtype=torch.int64), rows)
                view = bank.view(DEV)
                gemm = graph_ms([lambda: torch.matmul(x, w.t(), out=y)])
                delta = graph_ms([lambda: K.grouped_delta(y, x, g.rows, g.slot_start, g.max_rows, view)])
                ranks = sum(CLEF_RANKS) + ADAPTER_RANK * adapters  # per member, one slot's rows each
                flops = 2 * rows * (k * len(members) + n) * ranks
                bytes_ = 2 * (ranks * len(members) * k + ranks * n) + 2 * 2 * t * n
                floor = max(flops / c["mm_tflops"] / 1e9, bytes_ / c["copy_tbs"] / 1e9)
                if gemm and delta:
                    print(f"{name:18} {slots:5d} {rows:6d} {gemm:8.3f} {delta:8.3f} {delta / gemm:10.2f} {floor:14.3f}",
                          flush=True)


if __name__ == "__main__":
    main()
