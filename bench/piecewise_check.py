"""Where a piecewise CUDA graph replay (qv/engine/piecewise_graphs.py) departs from the eager forward, on
the GPU at the 27B's layer shapes with random GPTQ-Int8 weights: per row count, the eager forward run
twice (is the forward itself deterministic?), the pieces run eagerly between the cores (is the split
faithful?), then replayed (does capture change a kernel?), and per piece the buffers where the replay
and the eager pieces first differ.

    python bench/piecewise_check.py --layers 4 --sizes 128,160,448
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "engine"))

from shapes_27b import write_27b_config  # noqa: E402

from qv.config import EngineConfig  # noqa: E402
from qv.engine.cuda_graphs import replay_error  # noqa: E402
from qv.engine.engine import LLMEngine  # noqa: E402
from qv.engine.piecewise_graphs import PiecewiseGraphs  # noqa: E402


def check(eng: LLMEngine, pg: PiecewiseGraphs, t: int) -> None:
    """Size t of pg (captured already): the forward, the eager pieces and the replay, compared."""
    model = eng.runner.model
    r = eng.runner
    snaps: dict[tuple[str, int], dict] = {}

    def snapshot(tag: str):
        def piece(i: int) -> None:
            pg._piece(i, t) if tag.startswith("eager") else pg.graphs[t][i].replay()
            torch.cuda.synchronize()
            snaps[(tag, i)] = {k: v[:t].float().clone() for k, v in pg.buffers.items()}
            snaps[(tag, i)].update({("core_out", kind): v[:t].float().clone() for kind, v in pg.core_out.items()})
        return piece

    with model.kernels_as_captured():
        e1 = model.forward(pg.ids[:t], pg.positions[:t], pg._check_inputs(t), r.cache).clone()
        e2 = model.forward(pg.ids[:t], pg.positions[:t], pg._check_inputs(t), r.cache).clone()
        u = pg._cores_and_pieces(t, pg._check_inputs(t), snapshot("eager")).clone()
        u2 = pg._cores_and_pieces(t, pg._check_inputs(t), snapshot("eager2")).clone()
        g = pg._cores_and_pieces(t, pg._check_inputs(t), snapshot("replay")).clone()
        torch.cuda.synchronize()
    print(f"{t} rows: forward vs forward {replay_error(e2, e1):.2e}, pieces eagerly twice {replay_error(u2, u):.2e}, "
          f"pieces run eagerly vs forward "
          f"{replay_error(u, e1):.2e}, replay vs pieces run eagerly {replay_error(g, u):.2e}, replay vs forward "
          f"{replay_error(g, e1):.2e}", flush=True)
    for other, what in (("eager2", "eager pieces run again"), ("replay", "replay")):
        print(f"  {what} vs the eager pieces (core_out: the core before the piece):", flush=True)
        for i in range(len(model.layers) + 1):
            a, b = snaps[("eager", i)], snaps[(other, i)]
            # what this piece wrote, and the core output it read (the other buffers hold older layers' rows)
            kind = model.layers[i].kind if i < len(model.layers) else None
            fresh = [k for k in a if (k[0] in ("core", "carry") and k[1] == kind) or (k[0] == "hidden" and kind is None)
                     or (k[0] == "core_out" and i > 0 and k[1] == model.layers[i - 1].kind)]
            differ = {"/".join(map(str, k)): f"{replay_error(b[k].flatten(1), a[k].flatten(1)):.1e}" for k in fresh
                      if not torch.equal(a[k], b[k])}
            print(f"    after piece {i}: {differ or 'every buffer bit-equal'}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--sizes", default="128,160,448", help="row counts to capture and check")
    ap.add_argument("--capture", choices=("alone", "together", "together-own-pool", "pool-per-size"),
                    default="alone",
                    help="alone: each size captured by itself in its own pool, then checked; together: every size up "
                    "to the largest captured largest first in the decode graphs' pool, as start-up does, then each "
                    "checked (-own-pool: one pool of their own); pool-per-size: the listed sizes each in a pool of "
                    "its own, all captured before the checks")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    folder = write_27b_config(Path(tempfile.mkdtemp(prefix="qv-pieces-")), args.layers, 4096)
    eng = LLMEngine(EngineConfig.from_env(
        environ={}, model=folder, device="cuda", dtype="bfloat16", load_format="random", quantization="gptq-int8",
        kv_dtype="int8", max_model_len=4096, max_num_seqs=64, kv_cache_bytes=1 << 30, piecewise_graph_max_rows=0))
    print(f"{torch.cuda.get_device_name()}, {args.layers} layers of the 27B shapes, sizes captured {args.capture}",
          flush=True)
    r, sizes = eng.runner, [int(x) for x in args.sizes.split(",")]
    together, alone = None, {}
    if args.capture == "pool-per-size":
        for t in reversed(sizes):
            alone[t] = PiecewiseGraphs(r.model, r.cache, r.inputs, t, r.scratch_slot)
            alone[t].sizes = [t]
            with r.model.kernels_as_captured():
                alone[t]._capture_one(t)
    elif args.capture != "alone":
        pool = r.graphs.pool if args.capture == "together" else None
        together = PiecewiseGraphs(r.model, r.cache, r.inputs, max(sizes), r.scratch_slot, pool=pool)
        with r.model.kernels_as_captured():
            for t in reversed(together.sizes):
                together._capture_one(t)
        print(f"captured {together.sizes}", flush=True)
    for t in sizes:
        pg = together or alone.get(t)
        if pg is None:
            pg = PiecewiseGraphs(r.model, r.cache, r.inputs, t, r.scratch_slot)
            pg.sizes = [t]
            with r.model.kernels_as_captured():
                pg._capture_one(t)
        check(eng, pg, t)


if __name__ == "__main__":
    main()
