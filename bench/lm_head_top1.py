"""The MTP drafter's greedy token at Qwen3.5-27B's lm_head (V 248,320 x H 5,120, bf16): lm_head_top1 over the
int4 and int8 ranking copies and the dense weight, against torch's `(x @ W.T).float().argmax(-1)` and the
floor (the ranking copy's bytes at 4.24 TB/s), for R rows; then how often the result is not the exact
argmax (the exact best missed the shortlist), on random data of three kinds. One table each.

    python bench/lm_head_top1.py [--rows 1,4,16,64] [--miss-rows 4096] [--sweep]

Times are CUDA-graph replays (triton.testing.do_bench_cudagraph; the weights are 10x the L2, so nothing
stays cached between calls). Miss data, random Gaussian rows of W (std 0.02) and x (std 1) unless said:
  gaussian  - logits Gaussian over the vocabulary: many tokens near the best (top-1 probability ~5%), the hard case
  outliers  - as gaussian, with 16 hidden channels of W 6x larger (they set the row scales, coarsening the rest)
  peaked    - x pushed toward one random token's row so it leads by ~3 logit std, like a confident LM
--sweep times pass 1 over a grid of tiles (how configs.rank_config was chosen).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qv import kernels as K  # noqa: E402
from qv.kernels.lm_head_top1 import build_top1_ranking, configs  # noqa: E402
from qv.kernels.lm_head_top1 import reference as top1_reference  # noqa: E402
from qv.kernels.lm_head_top1 import triton as top1_triton  # noqa: E402

DEV = torch.device("cuda")
V, H = 248320, 5120
HBM_TBS = 4.24
SHORTLISTS = (8, 16, 32, 64, 128)


def graph_ms(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=200, return_mode="median")


def time_table(w, rankings, rows_list) -> None:
    print("| R | torch ms | dense ms | int8 ms | int8 floor | int4 ms | int4 pass 1 | int4 floor | int4 x3 steps |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for rows in rows_list:
        x = torch.randn(rows, H, device=DEV).to(torch.bfloat16)
        ref = top1_reference.lm_head_top1(x, w)
        t = {"torch": graph_ms(lambda: (x @ w.T).float().argmax(-1)),
             "dense": graph_ms(lambda: top1_triton.lm_head_top1(x, w, None))}
        for bits, rk in rankings.items():
            t[bits] = graph_ms(lambda rk=rk: top1_triton.lm_head_top1(x, w, rk))
        t["pass1"] = graph_ms(lambda: top1_triton.tile_candidates(x, rankings[4]))
        assert torch.equal(top1_triton.lm_head_top1(x, w, None), ref), "dense path differs from the reference"
        floor = {b: rk.nbytes / HBM_TBS / 1e9 for b, rk in rankings.items()}
        print(f"| {rows} | {t['torch']:.3f} | {t['dense']:.3f} | {t[8]:.3f} | {floor[8]:.3f} | {t[4]:.3f} | "
              f"{t['pass1']:.3f} | {floor[4]:.3f} | {3 * t[4]:.3f} |", flush=True)


def inputs(kind: str, w: torch.Tensor, rows: int, gen: torch.Generator):
    x = torch.randn(rows, H, device=DEV, generator=gen)
    if kind == "peaked":
        t = torch.randint(0, V, (rows,), device=DEV, generator=gen)
        wt = w[t].float()
        sigma = x.norm(dim=1, keepdim=True) * 0.02  # the logits' std over the vocabulary
        x = x + wt * (3 * sigma + 4.6 * sigma) / wt.square().sum(1, keepdim=True)  # ~3 std over the usual max
    return x.to(torch.bfloat16)


def miss_table(weights, miss_rows: int) -> None:
    """Rows where the op is not the exact argmax, and where the exact best falls off a shortlist of each
    length (its rank among pass 1's candidates by approximate score, or absent from its tile's best)."""
    print(f"\n| data | bits | rows | op != exact | shortlist {configs.TOPK} | "
          + " | ".join(f"miss @{k}" for k in SHORTLISTS) + " |")
    print("| --- | ---: | ---: | ---: | --- | " + " | ".join("---:" for _ in SHORTLISTS) + " |")
    gen = torch.Generator(device=DEV).manual_seed(0)
    for kind, (w, rankings) in weights.items():
        for bits, rk in rankings.items():
            wrong, miss = 0, torch.zeros(len(SHORTLISTS), dtype=torch.int64)
            for _ in range(0, miss_rows, 64):
                x = inputs(kind, w, 64, gen)
                ref = top1_reference.lm_head_top1(x, w)
                wrong += int((top1_triton.lm_head_top1(x, w, rk) != ref).sum())
                cv, ci = top1_triton.tile_candidates(x, rk)
                on = ci.long() == ref[:, None]
                value = torch.where(on, cv, float("-inf")).max(1, keepdim=True).values
                rank = torch.where(on.any(1), (cv > value).sum(1), 1 << 30)
                miss += torch.stack([(rank >= k).sum() for k in SHORTLISTS]).cpu()
            rates = " | ".join(f"{m / miss_rows:.2e}" for m in miss.tolist())
            print(f"| {kind} | {bits} | {miss_rows} | {wrong / miss_rows:.2e} | {configs.TOPK[bits]} | {rates} |",
                  flush=True)


def sweep_grid(rows: int):
    if rows == 1:
        return [dict(BLOCK_R=1, BLOCK_V=bv, BLOCK_W=bw, num_warps=nw) for bv in (32, 64, 128) for bw in (32, 64)
                for nw in (4, 8)]
    return [dict(BLOCK_R=br, BLOCK_V=bv, BLOCK_W=bw, num_warps=nw) for br in (4, 8) for bv in (8, 16, 32)
            for bw in (16, 32, 64) for nw in (1, 2) if br * bv * bw <= 128 * 32 * nw]  # <= 128 partials a thread


def sweep(rankings, rows_list) -> None:
    """Pass 1 over the int4 copy (int8 reads at the HBM floor with the defaults) for each tile config."""
    print("\n| R | BLOCK_R | BLOCK_V | BLOCK_W | warps | pass 1 ms |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    rk = rankings[4]
    for rows in rows_list:
        x = torch.randn(rows, H, device=DEV)
        results = []
        for cfg in sweep_grid(rows):
            try:
                results.append((graph_ms(lambda c=cfg: top1_triton.tile_candidates(x, rk, c)), cfg))
            except Exception as e:  # a config that does not compile is reported, not fatal
                print(f"    {cfg}: {type(e).__name__}: {str(e)[:100]}")
        results.sort(key=lambda r: r[0])
        for ms, cfg in results[:4]:
            tiles = f"{cfg['BLOCK_R']} | {cfg['BLOCK_V']} | {cfg['BLOCK_W']} | {cfg['num_warps']}"
            print(f"| {rows} | {tiles} | {ms:.4f} |", flush=True)
        default = configs.rank_config(DEV, rows, 4)
        print(f"    default {default}: {graph_ms(lambda: top1_triton.tile_candidates(x, rk)):.4f} ms", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4,16,64")
    ap.add_argument("--miss-rows", type=int, default=4096)
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    torch.manual_seed(0)
    K.set_backend("triton")
    w = (torch.randn(V, H, device=DEV) * 0.02).to(torch.bfloat16)
    rankings = {8: build_top1_ranking(w, 8), 4: build_top1_ranking(w, 4)}
    print(f"lm_head [{V}, {H}] bf16 {w.numel() * 2 / 1e9:.2f} GB; ranking copies int8 "
          f"{rankings[8].nbytes / 1e9:.2f} GB, int4 {rankings[4].nbytes / 1e9:.2f} GB; floor at {HBM_TBS} TB/s\n",
          flush=True)
    time_table(w, rankings, rows_list)
    if args.sweep:
        sweep(rankings, rows_list)
    w_out = w.clone()
    w_out[:, torch.randperm(H, device=DEV)[:16]] *= 6
    weights = {"gaussian": (w, rankings), "peaked": (w, rankings),
               "outliers": (w_out, {b: build_top1_ranking(w_out, b) for b in (4, 8)})}
    miss_table(weights, args.miss_rows)


if __name__ == "__main__":
    main()
