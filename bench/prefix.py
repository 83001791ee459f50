"""Prefix caching: time to first token of a request that shares a long prefix with an earlier one,
against the same request cold, plus the memory/recompute trade-off of the GDN snapshot spacing.

    python bench/prefix.py                    # GPU: 0.5B-shaped and 27B-shaped (8 of 64 layers), 32K prefix
    python bench/prefix.py --smoke            # CPU: tiny model, short prefix (checks the script works)

Models are random bf16 weights in a preset's layer shapes, written once under --dir. The
vocabulary is the tiny tokenizer's: the lm_head runs on one row per request, so it does not move
TTFT. The 27B shape keeps 8 of its 64 layers (6 GDN + 2 attention, its own 3:1 pattern) because
a 64-layer random checkpoint does not fit the device's disk; per-layer costs (prefill, snapshot
copies) scale with the layer count, so the speed-up holds for the full model. Each TTFT is the
median of --reps requests with fresh random prefixes, after a warm-up that compiles every kernel
path (cold chunks, a resumed prefix).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qv import LLM, SamplingParams  # noqa: E402
from qv.config import ModelConfig  # noqa: E402
from qv.engine.state_pool import block_tensors, slot_tensors  # noqa: E402
from qv.model import tiny  # noqa: E402
from qv.model.cache import gdn_bytes_per_slot, kv_bytes_per_block  # noqa: E402

ONE = SamplingParams(temperature=0, max_tokens=1)


def write_model(root: Path, preset: str, layers: int, max_len: int, dtype: torch.dtype, weights: bool = True) -> Path:
    """A preset-shaped checkpoint folder; weights=False writes only config.json and the tokenizer (for
    load_format=random)."""
    out = root / f"{preset}-{layers or 'all'}l{'' if weights else '-config'}"
    if (out / "config.json").is_file():
        return out
    part = out.with_name(out.name + ".partial")
    shape = dict(tiny.PRESETS[preset])
    shape.pop("vocab_size", None)
    if layers:
        shape["num_hidden_layers"] = layers
    name = f"bench-{preset}-{layers}"
    tiny.PRESETS[name] = shape
    tiny.make_tiny(part, "gqa1")  # the tiny fixtures' tokenizer and generation files (text-only)
    _, special = tiny.tokenizer_json()
    config = tiny.build_config(name, (max(special.values()) + 1 + 63) // 64 * 64, special)
    config["max_position_embeddings"] = max_len
    if weights:
        print(f"writing random {preset}-shaped weights ({config['num_hidden_layers']} layers) to {out}", flush=True)
        save_file(tiny.random_tensors(config, seed=0, dtype=dtype), str(part / "model.safetensors"),
                  metadata={"format": "pt"})
    else:
        (part / "model.safetensors").unlink()  # the tiny fixture's: random weights are made at load
    (part / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    part.rename(out)
    return out


def _sync(llm: LLM) -> None:
    if llm.engine.runner.device.type == "cuda":
        torch.cuda.synchronize()


def ttft(llm: LLM, ids: list[int]) -> tuple[float, int]:
    """Seconds from submission to the first token, and how many prompt tokens came from the cache."""
    _sync(llm)
    t = time.perf_counter()
    out = llm.generate({"prompt_token_ids": ids}, ONE)[0]
    _sync(llm)
    return time.perf_counter() - t, out.num_cached_tokens


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 250) for _ in range(n)]


def run_pairs(llm: LLM, prefix_len: int, suffix_len: int, reps: int, seed: int, warm_len: int) -> dict:
    """Median cold and warm TTFT over `reps` fresh prefixes (the warm request shares the prefix)."""
    rng = random.Random(seed)
    w = _tokens(rng, warm_len)
    ttft(llm, w + _tokens(rng, suffix_len))  # warm-up: compile cold chunks...
    ttft(llm, w + _tokens(rng, suffix_len))  # ...and the resumed-prefix path
    cold, warm, cached = [], [], []
    for _ in range(reps):
        prefix = _tokens(rng, prefix_len)
        cold.append(ttft(llm, prefix + _tokens(rng, suffix_len))[0])
        t, c = ttft(llm, prefix + _tokens(rng, suffix_len))
        warm.append(t)
        cached.append(c)
    return {"cold": statistics.median(cold), "warm": statistics.median(warm), "cached": min(cached)}


def profile_warm(llm: LLM, prefix_len: int, suffix_len: int, seed: int, top: int = 25) -> None:
    """cProfile of one warm request (after its cold twin): where the warm TTFT goes on the host."""
    import cProfile
    import io
    import pstats
    rng = random.Random(seed + 1)
    prefix = _tokens(rng, prefix_len)
    ttft(llm, prefix + _tokens(rng, suffix_len))
    ids = prefix + _tokens(rng, suffix_len)
    prof = cProfile.Profile()
    prof.enable()
    t, _ = ttft(llm, ids)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    print(f"profile of one warm request ({t * 1e3:.1f} ms), by own time:\n{buf.getvalue()}", flush=True)


def snapshot_copy_ms(llm: LLM) -> tuple[float, float]:
    """Measured ms to take one snapshot (slot -> pool) and to restore one (pool -> slot)."""
    pc = llm.engine.prefix_cache
    n = 10
    _sync(llm)
    t = time.perf_counter()
    for i in range(n):
        pc.snaps.save([(0, b"bench-%d" % i)])
    _sync(llm)
    save = (time.perf_counter() - t) / n * 1e3
    t = time.perf_counter()
    for i in range(n):
        pc.snaps.load(b"bench-%d" % i, 0)
    _sync(llm)
    load = (time.perf_counter() - t) / n * 1e3
    llm.engine.reset_prefix_cache()
    return save, load


def measure(model_dir: Path, args, levers: dict) -> dict:
    max_len = args.prefix + 2 * args.suffix + 64
    print(f"{model_dir.name}: loading, then cold/warm pairs with prefix caching on", flush=True)
    llm = LLM(model=str(model_dir), max_model_len=max_len, **levers)
    pc = llm.engine.prefix_cache
    row = run_pairs(llm, args.prefix, args.suffix, args.reps, args.seed, warm_len=2 * pc.interval + 50)
    if args.profile:
        profile_warm(llm, args.prefix, args.suffix, args.seed)
    row["interval"], row["snapshots"] = pc.interval, pc.snaps.num_snapshots
    row["snap_bytes"] = sum(t[0].numel() * t.element_size() for t in slot_tensors(llm.engine.runner.cache))
    row["block_bytes"] = sum(t[0].numel() * t.element_size() for t in block_tensors(llm.engine.runner.cache))
    row["save_ms"], row["load_ms"] = snapshot_copy_ms(llm)
    del llm, pc
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    print(f"{model_dir.name}: cold requests with prefix caching off", flush=True)
    off = LLM(model=str(model_dir), max_model_len=max_len, **dict(levers, prefix_caching=False))
    row["cold_off"] = run_pairs(off, args.prefix, args.suffix, args.reps, args.seed, warm_len=128)["cold"]
    del off
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def tradeoff_rows(name: str, cfg: ModelConfig, block_size: int, act: torch.dtype, tok_per_s: float) -> list[str]:
    """Snapshot spacing vs memory and recompute, from the model's exact cache shapes."""
    kv_tok = kv_bytes_per_block(cfg, block_size, act) / block_size
    rows = []
    for state in (torch.float32, torch.int16):
        snap = gdn_bytes_per_slot(cfg, act, state)
        for iv in (1024, 2048, 4096, 8192, 16384):
            snap_tok = snap / iv
            share = snap_tok / (kv_tok + snap_tok)
            rows.append(f"| {name} | {str(state).removeprefix('torch.')} | {snap / 2**20:.1f} | {iv} | "
                        f"{kv_tok / 1024:.1f} + {snap_tok / 1024:.1f} | {share:.0%} | "
                        f"{2**30 / (kv_tok + snap_tok) / 1000:.1f}K | {iv / 2 / tok_per_s * 1e3:.0f} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, short prefix")
    ap.add_argument("--prefix", type=int, default=32768, help="shared prefix tokens")
    ap.add_argument("--suffix", type=int, default=64, help="tokens after the prefix (differ per request)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--presets", default="0.5b,27b")
    ap.add_argument("--layers-27b", type=int, default=8, help="layers of the 27B shape to keep (0: all 64)")
    ap.add_argument("--interval", type=int, default=0, help="gdn_snapshot_interval (0: automatic)")
    ap.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--kv-bytes", type=int, default=16 << 30, help="kv_cache_bytes (blocks + snapshots)")
    ap.add_argument("--dir", default="", help="where model folders are written (default: a temp dir)")
    ap.add_argument("--profile", action="store_true", help="also print a cProfile of one warm request")
    args = ap.parse_args()
    levers = dict(gdn_snapshot_interval=args.interval, max_num_batched_tokens=args.chunk,
                  kv_cache_bytes=args.kv_bytes)
    if args.smoke:
        args.prefix, args.suffix, args.reps, args.presets = 256, 16, 1, "tiny"
        levers.update(device="cpu", gdn_snapshot_interval=args.interval or 32, max_num_batched_tokens=64,
                      kv_cache_bytes=64 << 20)
    elif not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --smoke on CPU")
    root = Path(args.dir or tempfile.mkdtemp(prefix="qv-prefix-"))
    results, trade = [], []
    for preset in args.presets.split(","):
        layers = args.layers_27b if preset == "27b" else 0
        if args.smoke:
            model_dir = tiny.make_tiny(root / "tiny", "tiny")
        else:
            model_dir = write_model(root, preset, layers, args.prefix + 2 * args.suffix + 4096, torch.bfloat16)
        row = measure(model_dir, args, levers)
        cfg = ModelConfig.from_dir(model_dir)
        name = f"{preset} ({cfg.num_hidden_layers} layers)"
        results.append((name, row))
        act = torch.float32 if args.smoke else torch.bfloat16
        tok_s = args.prefix / row["cold_off"]
        trade += tradeoff_rows(name, cfg, 16, act, tok_s)
        if preset == "27b" and layers:  # the full model's snapshot bytes, from its exact shapes
            full = dict(tiny.PRESETS["27b"])
            full.pop("vocab_size")
            tiny.PRESETS["bench-27b-full"] = full
            _, special = tiny.tokenizer_json()
            full_cfg = ModelConfig.from_dict(tiny.build_config("bench-27b-full", 512, special))
            trade += tradeoff_rows("27b (64 layers)", full_cfg, 16, act, tok_s * layers / 64)
    print(f"\nTTFT, prefix {args.prefix} + suffix {args.suffix} tokens, median of {args.reps}; device "
          f"{torch.cuda.get_device_name() if not args.smoke else 'cpu'}")
    print("| model | interval | cached tokens | cold, caching off (s) | cold, caching on (s) | warm (s) | "
          "speed-up vs off | snapshot MiB | take / restore (ms) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in results:
        print(f"| {name} | {r['interval']} | {r['cached']} | {r['cold_off']:.3f} | {r['cold']:.3f} | "
              f"{r['warm']:.4f} | {r['cold_off'] / r['warm']:.1f}x | {r['snap_bytes'] / 2**20:.1f} | "
              f"{r['save_ms']:.2f} / {r['load_ms']:.2f} |")
    print("\nSnapshot spacing trade-off (KV + snapshot bytes per cached token; recompute = mean tokens past the "
          "last snapshot on a hit at the measured cold prefill rate)")
    print("| model | state | snapshot MiB | interval | KiB/token KV + snap | snapshot share | tokens per GiB | "
          "mean recompute (ms) |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(trade))


if __name__ == "__main__":
    main()
