"""Where a piecewise CUDA graph replay (qv/engine/piecewise_graphs.py) departs from the eager forward, on
the GPU at the 27B's layer shapes with random GPTQ-Int8 weights: per row count, the replay (first and
unsynchronized, as the start-up check runs it), the eager forward twice (is the forward deterministic?),
the pieces run eagerly between the cores twice (is the split faithful?), the replay again piece by piece;
where any pair differs, per piece the buffers where the replays and the eager pieces first differ.

    python bench/piecewise_check.py --layers 4 --sizes 128,160,448
    python bench/piecewise_check.py --layers 64 --clef --capture together --sizes 96,448 --poison
    # as the engine's start-up does it (bench/clef.py's levers: a 16-bit KV cache, a server's memory plan, no
    # step run before); --attention-tma: with the prefill attention's TMA copies (the default until then)
    python bench/piecewise_check.py --layers 64 --clef --capture together --sizes all --no-warm-up \
        --lever kv_dtype=auto --lever max_num_batched_tokens=8192 --lever max_model_len=1088 --lever kv_cache_bytes=0
    # is the eager forward itself deterministic there (20 more runs a size); with the 128 x 128 GEMM tiles at
    # 65-511 rows as before (--chunked-rows 512), by TMA or by plain loads
    python bench/piecewise_check.py ... --repeat 20 --chunked-rows 512 [--gemm tma=False]
"""

from __future__ import annotations

import argparse
import ast
import importlib
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "engine"))

from shapes_27b import write_27b_config  # noqa: E402

from qv.bench.clef_folder import add_clef  # noqa: E402
from qv.config import EngineConfig  # noqa: E402
from qv.engine.cuda_graphs import REPLAY_BOUND, replay_error  # noqa: E402
from qv.engine.engine import LLMEngine  # noqa: E402
from qv.engine.piecewise_graphs import ROW_BUCKETS, PiecewiseGraphs  # noqa: E402


def poisoned_forward(eng: LLMEngine, pg: PiecewiseGraphs, t: int, clean: torch.Tensor) -> None:
    """The eager forward again with the allocator's free memory NaN first (a kernel that reads memory its
    tensors never wrote then gives NaN or other values), layer by layer against a clean run."""
    model, r = eng.runner.model, eng.runner

    def layers(poison_first: bool) -> list[torch.Tensor]:
        out = []
        h, residual = model.embed(pg.ids[:t]), None
        batch = pg._check_inputs(t)
        for layer in model.layers:
            if poison_first:
                free = torch.cuda.mem_get_info()[0]
                junk = torch.full(((min(free // 2, 8 << 30)) // 2,), float("nan"), dtype=torch.bfloat16,
                                  device=model.device)
                del junk  # its block stays in the allocator's cache: the layer's fresh tensors are carved from it
            h, residual = layer(h, residual, pg.positions[:t], batch, r.cache)
            out.append(torch.cat([h.float(), residual.float()], -1).clone())
        out.append(model.final_norm(h, residual).float().clone())
        return out

    a, b = layers(False), layers(True)
    torch.cuda.synchronize()
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if not torch.equal(x, y)), None)
    print(f"{t} rows: forward layer by layer vs forward {replay_error(a[-1], clean.float()):.2e}; with NaN-filled "
          f"free memory {replay_error(b[-1], a[-1]):.2e} (NaN rows {int(b[-1].isnan().any(-1).sum())}), first "
          f"differing layer: {first if first is None or first == len(model.layers) else (first, model.layers[first].kind)}",
          flush=True)


def override_config(module: str, name: str, settings: dict) -> None:
    """The config function `name` of a kernel module (as the module calls it) with `settings` over its own."""
    kernels = importlib.import_module(module)  # by module path: the kernel packages' names shadow attribute access
    config = getattr(kernels, name)
    setattr(kernels, name, lambda *a: dict(config(*a), **settings))


def repeat_forward(eng: LLMEngine, pg: PiecewiseGraphs, t: int, n: int, first: torch.Tensor) -> None:
    """The eager forward n more times, every other one synchronized before it starts: how often and how far it
    departs from the first (a deterministic forward never does; a race shows as a rate)."""
    model = eng.runner.model
    errors = []
    with model.kernels_as_captured():
        for k in range(n):
            if k % 2:
                torch.cuda.synchronize()
            e = model.forward(pg.ids[:t], pg.positions[:t], pg._check_inputs(t), eng.runner.cache)
            errors.append(replay_error(e, first))
    torch.cuda.synchronize()
    differ = [f"{x:.1e}" for x in errors if x > 0]
    print(f"{t} rows: {len(differ)} of {n} more eager forwards differ from the first"
          f"{': ' + ', '.join(differ) if differ else ''}", flush=True)


def check(eng: LLMEngine, pg: PiecewiseGraphs, t: int, poison: bool = False, repeat: int = 0) -> None:
    """Size t of pg (captured already): the forward, the eager pieces and the replay, compared (poison: also
    with NaN in the allocator's free memory and in the static buffers past row t; repeat: that many more eager
    forwards against the first, and no per-piece detail)."""
    model = eng.runner.model
    r = eng.runner
    snaps: dict[tuple[str, int], dict] = {}

    def snapshot(tag: str):
        def piece(i: int) -> None:
            pg._piece(i, t) if tag.startswith("eager") else pg.graphs[t][i].replay()
            torch.cuda.synchronize()
            if repeat:  # no per-piece detail: its copies filled a server's memory plan
                return
            snaps[(tag, i)] = {k: v[:t].float().clone() for k, v in pg.buffers.items()}
            snaps[(tag, i)].update({("core_out", kind): v[:t].float().clone() for kind, v in pg.core_out.items()})
        return piece

    with model.kernels_as_captured():
        # the replay first and unsynchronized, as the start-up check runs it (a first run of some kernel at this
        # size, or a race that per-piece synchronization would hide, shows here)
        g = pg._cores_and_pieces(t, pg._check_inputs(t), lambda i: pg.graphs[t][i].replay()).clone()
        e1 = model.forward(pg.ids[:t], pg.positions[:t], pg._check_inputs(t), r.cache).clone()
        e2 = model.forward(pg.ids[:t], pg.positions[:t], pg._check_inputs(t), r.cache).clone()
        u = pg._cores_and_pieces(t, pg._check_inputs(t), snapshot("eager")).clone()
        u2 = pg._cores_and_pieces(t, pg._check_inputs(t), snapshot("eager2")).clone()
        g2 = pg._cores_and_pieces(t, pg._check_inputs(t), snapshot("replay")).clone()
        torch.cuda.synchronize()
        if poison:
            poisoned_forward(eng, pg, t, e1)
            with torch.inference_mode():  # the buffers are inference tensors
                for buf in list(pg.buffers.values()) + list(pg.core_out.values()):
                    if buf.is_floating_point():
                        buf[t:].fill_(float("nan"))
            u3 = pg._cores_and_pieces(t, pg._check_inputs(t), snapshot("eager-poisoned")).clone()
            torch.cuda.synchronize()
            print(f"{t} rows: pieces with NaN past row {t} vs pieces {replay_error(u3, u):.2e} "
                  f"(NaN rows: {int(u3.isnan().any(-1).sum())})", flush=True)
    worst = max(replay_error(x, y) for x, y in ((g, e1), (e2, e1), (u, e1), (u2, u), (g, u), (g2, g)))
    print(f"{t} rows: {'AGREE' if worst <= REPLAY_BOUND else 'DIFFER'}; replay vs forward {replay_error(g, e1):.2e}, "
          f"forward vs forward {replay_error(e2, e1):.2e}, pieces run eagerly vs forward {replay_error(u, e1):.2e}, "
          f"pieces eagerly twice {replay_error(u2, u):.2e}, replay vs pieces run eagerly {replay_error(g, u):.2e}, "
          f"replay piece by piece (synchronized) vs replay {replay_error(g2, g):.2e}", flush=True)
    if repeat:
        return repeat_forward(eng, pg, t, repeat, e1)
    if worst <= REPLAY_BOUND and not poison:
        return
    others = (("eager2", "eager pieces run again"), ("replay", "replay"))
    for other, what in others + ((("eager-poisoned", "pieces with NaN past the rows"),) if poison else ()):
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
    ap.add_argument("--sizes", default="128,160,448",
                    help="row counts to capture and check, or 'all': every bucket up to 512, checked smallest first "
                    "as start-up does")
    ap.add_argument("--capture", choices=("alone", "together", "together-own-pool", "pool-per-size"),
                    default="alone",
                    help="alone: each size captured by itself in its own pool, then checked; together: every size up "
                    "to the largest captured largest first in the decode graphs' pool, as start-up does, then each "
                    "checked (-own-pool: one pool of their own); pool-per-size: the listed sizes each in a pool of "
                    "its own, all captured before the checks")
    ap.add_argument("--clef", action="store_true",
                    help="with a random Clef folder (LoRA + deabl deltas on the last 3/8 of the layers, 4 slots): "
                    "its linears run unfused with the grouped delta launches, as bench/clef.py's engine does")
    ap.add_argument("--poison", action="store_true",
                    help="also: the forward with NaN-filled free memory, layer by layer, and the eager pieces with "
                    "NaN in the static buffers past the step's rows (a kernel reading memory it should not)")
    ap.add_argument("--lever", action="append", default=[], metavar="NAME=VALUE",
                    help="an engine lever over this script's defaults (repeatable), e.g. kv_cache_bytes=0 for the "
                    "memory plan of a server")
    ap.add_argument("--no-warm-up", action="store_true",
                    help="capture and check before the engine has run any step, as start-up does (the engine's "
                    "warm-up runs after its graphs)")
    ap.add_argument("--attention-tma", action="store_true",
                    help="the prefill attention kernel loads a 16-bit cache's chunk keys by TMA bulk copies (sm_90+), "
                    "the default before the start-up check failed with 16-bit caches at sizes past one key tile")
    ap.add_argument("--gemm", action="append", default=[], metavar="KEY=VALUE",
                    help="a setting of the tensor-core GPTQ GEMM's tiles over configs.tc_config's (repeatable), e.g. "
                    "tma=False (plain loads, not TMA bulk copies), STAGES=3, SWAP=False")
    ap.add_argument("--chunked-rows", type=int, default=None, metavar="N",
                    help="rows from which the linears take the chunked dequantization + cuBLAS (configs.CHUNKED_ROWS; "
                    "512 brings back the 128 x 128 tensor-core tiles at 65-511 rows, which raced there with TMA)")
    ap.add_argument("--repeat", type=int, default=0, metavar="N",
                    help="per size, N more eager forwards against the first (every other one after a synchronize), "
                    "instead of the per-piece detail")
    args = ap.parse_args()
    if args.gemm:
        settings = {key: ast.literal_eval(value) for key, value in (item.split("=", 1) for item in args.gemm)}
        override_config("qv.kernels.linear.triton", "tc_config", settings)
    if args.chunked_rows is not None:
        importlib.import_module("qv.kernels.linear.configs").CHUNKED_ROWS = args.chunked_rows
    if args.attention_tma:
        override_config("qv.kernels.paged_attention.triton", "attn_config", {"tma": True})
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    folder = write_27b_config(Path(tempfile.mkdtemp(prefix="qv-pieces-")), args.layers, 4096)
    clef = {}
    if args.clef:
        folder = str(add_clef(Path(folder), "27b"))
        clef = dict(clef_slots=4, clef_nmax=1024)
    levers = dict(device="cuda", dtype="bfloat16", load_format="random", quantization="gptq-int8", kv_dtype="int8",
                  max_model_len=4096, max_num_seqs=64, kv_cache_bytes=1 << 30, piecewise_graph_max_rows=0,
                  warm_up=not args.no_warm_up, **clef)
    levers.update(dict(item.split("=", 1) for item in args.lever))
    eng = LLMEngine(EngineConfig.from_env(environ={}, model=folder, **levers))
    print(f"{torch.cuda.get_device_name()}, {args.layers} layers of the 27B shapes{' with Clef' if args.clef else ''}, "
          f"sizes captured {args.capture}", flush=True)
    r = eng.runner
    sizes = ([t for t in ROW_BUCKETS if t <= 512] if args.sizes == "all" else [int(x) for x in args.sizes.split(",")])
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
        check(eng, pg, t, args.poison, args.repeat)


if __name__ == "__main__":
    main()
