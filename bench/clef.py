"""Clef decisions through the engine: records/s and p50/p95 latency for 1K, 8K and 32K-token records,
alone and with 6 chats decoding beside them, at a 0.5B-shaped and a 27B-shaped model. One table.

    python bench/clef.py                 # GPU: 0.5B-shaped and 27B-shaped (8 of 64 layers)
    python bench/clef.py --smoke         # CPU: the tiny model, short records (checks the script works)
    python bench/clef.py --step-targets 30ms,2x,off   # records beside chats under each step latency target

Models are random bf16 weights in a preset's layer shapes (bench/prefix.py's writer) plus a Clef
folder in the original stack's layout, written here with random values: `clef/` holds a joint
schema head (width 1024 for 27B, 512 for 0.5B), a PEFT LoRA adapter on every decoder linear of the
last 3/8 of the layers (rank 256 for 27B like the original's layers 40-63, 64 for 0.5B) and a
rank-1 deabl adapter on o_proj/out_proj/down_proj of layers 2.., so Clef rows pay for the deltas.
The 27B shape keeps 8 of its 64 layers (6 GDN + 2 attention) by default because a 64-layer random
checkpoint does not fit the device's disk; prefill cost scales with the layer count, so records/s
of the full model is about 8x lower (say so when quoting). Records are cut to the exact length
with `max_length` (the state is truncated as Clef does). Each case submits all its records at
once (clef_slots in flight, the rest queue): latency is submission to answer, queueing included.
"""

from __future__ import annotations

import argparse
import gc
import logging
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prefix import write_model  # noqa: E402
from qv.bench.clef_folder import add_clef  # noqa: E402
from qv.clef.request import encode_request  # noqa: E402
from qv.config import EngineConfig  # noqa: E402
from qv.engine.engine import LLMEngine  # noqa: E402
from qv.engine.request import SamplingParams  # noqa: E402
from qv.model import tiny  # noqa: E402

WORDS = ("order checkout payment refund invoice outage latency login password error timeout shipping customer "
         "account warehouse delay urgent billing technical security fraud report").split()


# -- records and chats ---------------------------------------------------------------------------
QUESTIONS = {"down": {"type": "noul", "instructions": "Down?"},
             "team": {"type": "choice", "criteria": {"ops": None, "dev": None, "pay": None}},
             "level": {"type": "score", "criteria": ["low", "mid", "high"]}}


def make_records(tokenizer, n: int, length: int, cap: tuple[int, str], seed: int):
    """n records of exactly `length` tokens: three short questions (8 options; ~720 tokens with the
    bench models' small byte-level tokenizer) and a random state cut to fit."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        state = " ".join(rng.choice(WORDS) for _ in range(length))  # >= 1 token a word: cut to fit
        body = {"model": "clef", "state": state, "questions": QUESTIONS, "max_length": length}
        rec = encode_request(tokenizer, body, cap[0], cap_name=cap[1])
        assert rec.num_tokens == length, (rec.num_tokens, length)
        out.append(rec)
    return out


def run_case(eng: LLMEngine, records: list, chats: int, chat_prompt: int, chat_window_s: float = 0.0) -> dict:
    """Submit every record at once beside `chats` decoding chats (resubmitted as they end); step until
    the records are answered (or, with no records, for chat_window_s). Latency = submit -> answer."""
    rng = random.Random(len(records) * 7 + chats)
    params = SamplingParams(temperature=0.0, max_tokens=min(2048, eng.max_model_len - chat_prompt), ignore_eos=True)
    vocab = eng.model_config.vocab_size
    live, chat_tokens, serial = {}, 0, 0

    def add_chat():
        nonlocal serial
        rid = f"chat-{serial}"
        serial += 1
        eng.add_request(rid, [rng.randrange(3, min(vocab, 250)) for _ in range(chat_prompt)], params)
        live[rid] = 0

    for _ in range(chats):
        add_chat()
    t0 = time.perf_counter()
    submitted = {}
    for i, rec in enumerate(records):
        rid = f"clef-{i}-{rec.num_tokens}"
        eng.add_clef(rid, rec)
        submitted[rid] = time.perf_counter()
    latency, restarts, last_token, gaps = {}, 0, {}, []
    while len(latency) < len(records) or (not records and time.perf_counter() - t0 < chat_window_s):
        for out in eng.step():
            now = time.perf_counter()
            if out.request_id in submitted:
                if out.finished:
                    if out.clef is None:
                        raise RuntimeError(f"record {out.request_id} failed: {out.error}")
                    latency[out.request_id] = now - submitted[out.request_id]
                    restarts += out.clef.restarts
            elif out.request_id in live:
                n = len(out.outputs[0].token_ids)
                if n > live[out.request_id]:  # inter-token latency: from the chat's previous token
                    if out.request_id in last_token:
                        gaps.append((now - last_token[out.request_id]) / (n - live[out.request_id]))
                    last_token[out.request_id] = now
                live[out.request_id] = n
                if out.finished:
                    chat_tokens += live.pop(out.request_id)
                    add_chat()
    wall = time.perf_counter() - t0
    chat_tokens += sum(live.values())
    for rid in list(live):
        eng.abort_request(rid)
    lat = sorted(latency.values())
    return {"records": len(records), "records_s": len(records) / wall if records else float("nan"),
            "p50": _pct(lat, 0.5), "p95": _pct(lat, 0.95), "itl_p50": _pct(sorted(gaps), 0.5) * 1e3,
            "itl_p95": _pct(sorted(gaps), 0.95) * 1e3,
            "chat_tok_s": chat_tokens / wall if chats else float("nan"), "restarts": restarts}


def _pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def profile_mixed(eng: LLMEngine, record, chats: int, chat_prompt: int) -> str:
    """Per-kernel (GPU) and per-op (host) tables of steps that carry a long-prefill chunk beside
    decoding chats: with a Clef record, and with a chat prompt of the same length."""
    from qv.bench.profile import profile_markdown, profile_steps

    rng = random.Random(3)
    # chats that outlast the profile, within the model length the record lengths set
    params = SamplingParams(temperature=0.0, max_tokens=min(4096, eng.max_model_len - chat_prompt), ignore_eos=True)
    out = []
    for kind in ("clef", "chat"):
        for i in range(chats):
            eng.add_request(f"p-{kind}-{i}", [rng.randrange(3, 250) for _ in range(chat_prompt)], params)
        for _ in range(4):  # the chats' prompts in, decoding
            eng.step()
        if kind == "clef":
            eng.add_clef("p-rec", record)
        else:
            eng.add_request("p-long", [rng.randrange(3, 250) for _ in range(record.num_tokens)],
                            SamplingParams(temperature=0.0, max_tokens=1))
        for _ in range(3):
            eng.step()
        p = profile_steps(eng.step, 5, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        out.append(profile_markdown(f"{chats} chats decoding beside a {kind} prefill, per step", p))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                eng.step()
        out.append(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        for rid in [f"p-{kind}-{i}" for i in range(chats)] + ["p-rec", "p-long"]:
            eng.abort_request(rid)
        while eng.has_unfinished_requests():
            eng.step()
    return "\n\n".join(out)


def table_row(name: str, length, chats: int, target: str, r: dict) -> str:
    return (f"| {name} | {length} | {chats} | {target} | {r['records']} | {r['records_s']:.2f} | {r['p50']:.3f} | "
            f"{r['p95']:.3f} | {r['chat_tok_s']:.1f} | {r['itl_p50']:.2f} | {r['itl_p95']:.2f} | {r['restarts']} | "
            f"{r.get('peak_gib', float('nan')):.1f} |")


def target_lines(rows: list[tuple]) -> list[str]:
    """Issue 33's targets per record length and step target: chat ITL p95 beside records <= 2.5x alone,
    records/s beside chats >= 0.75x alone."""
    alone_chat = {name: r for name, length, chats, target, r in rows if length == "-"}
    alone_rec = {(name, length): r for name, length, chats, target, r in rows if length != "-" and chats == 0}
    out = []
    for name, length, chats, target, r in rows:
        if length == "-" or not chats or name not in alone_chat or (name, length) not in alone_rec:
            continue
        itl = r["itl_p95"] / alone_chat[name]["itl_p95"]
        rate = r["records_s"] / alone_rec[(name, length)]["records_s"]
        out.append(f"| {name} | {length} | {target} | {itl:.2f}x ({'met' if itl <= 2.5 else 'missed'}) | "
                   f"{rate:.2f}x ({'met' if rate >= 0.75 else 'missed'}) |")
    return out


def step_targets(spec: str) -> list[tuple[str, dict]]:
    """"30ms,2x,off" -> the scheduler settings of each: a target in ms, a multiple of a decode-only step, none."""
    out = []
    for word in filter(None, (w.strip() for w in spec.split(","))):
        if word == "off":
            out.append((word, dict(max_step_ms=0.0, max_step_decode_ratio=0.0)))
        elif word.endswith("ms"):
            out.append((word, dict(max_step_ms=float(word[:-2]), max_step_decode_ratio=0.0)))
        elif word.endswith("x"):
            out.append((word, dict(max_step_ms=0.0, max_step_decode_ratio=float(word[:-1]))))
        else:
            sys.exit(f"--step-targets: {word!r} is none of <ms>ms, <ratio>x, off")
    return out


def bench_model(model_dir: Path, preset: str, args) -> list[tuple]:
    levers = dict(max_model_len=max(args.lengths) + 64, max_num_batched_tokens=args.chunk, clef_slots=args.slots,
                  clef_nmax=max(args.lengths), long_prefill_token_threshold=args.long_prefill_token_threshold)
    if args.smoke:
        levers.update(device="cpu", kv_cache_bytes=256 << 20)
    if args.load_format == "random":
        levers.update(load_format="random", quantization="gptq-int8")
    levers.update(dict(item.split("=", 1) for item in args.lever))
    eng = LLMEngine(EngineConfig.from_env(environ={}, model=str(model_dir), **levers))
    cap = (eng.clef.cap, eng.clef.cap_name)
    n_layers = eng.model_config.num_hidden_layers
    name = f"{preset} ({n_layers} layers)"
    print(f"{name}: warm-up (every record length, chats)", flush=True)
    for length in args.lengths:
        run_case(eng, make_records(eng.tokenizer, 1, length, cap, seed=1), min(args.chats, 2), args.chat_prompt)
    rows = []
    if args.chats:
        r = run_case(eng, [], args.chats, args.chat_prompt, chat_window_s=args.chat_window)
        rows.append((name, "-", args.chats, "-", r))
    default = ("default", dict(max_step_ms=eng.scheduler.max_step_ms,
                               max_step_decode_ratio=eng.scheduler.max_step_decode_ratio))
    targets = step_targets(args.step_targets) or [default]
    for length, count in zip(args.lengths, args.counts):
        records = make_records(eng.tokenizer, count, length, cap, seed=length)
        # records alone never meet a decode, so the step target does not apply: one run serves every target
        cases = [(0, ("-", {}))] + ([(args.chats, t) for t in targets] if args.chats else [])
        for chats, (target, settings) in cases:
            for lever, value in settings.items():
                setattr(eng.scheduler, lever, value)
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            print(f"{name}: {count} records of {length} tokens, {chats} chats, step target {target}", flush=True)
            r = run_case(eng, records, chats, args.chat_prompt)
            r["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
            rows.append((name, length, chats, target, r))
            print("  " + table_row(*rows[-1]), flush=True)  # kept in the log if a later case runs out of time
    for lever, value in targets[0][1].items():  # the profile runs under the first target
        setattr(eng.scheduler, lever, value)
    if args.profile_mixed:
        print(profile_mixed(eng, make_records(eng.tokenizer, 1, max(args.lengths), cap, seed=9)[0], args.chats,
                            args.chat_prompt), flush=True)
    del eng
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, short records")
    ap.add_argument("--presets", default="0.5b,27b")
    ap.add_argument("--layers-27b", type=int, default=8, help="layers of the 27B shape to keep (0: all 64)")
    ap.add_argument("--lengths", default="1024,8192,32768", help="record lengths in tokens")
    ap.add_argument("--counts", default="32,16,8", help="records per case, one per length")
    ap.add_argument("--chats", type=int, default=6, help="chats decoding beside the records")
    ap.add_argument("--chat-prompt", type=int, default=256)
    ap.add_argument("--chat-window", type=float, default=5.0, help="seconds of the chats-only baseline")
    ap.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens")
    ap.add_argument("--slots", type=int, default=4, help="clef_slots")
    ap.add_argument("--long-prefill-token-threshold", type=int, default=0, help="the lever (0: its default)")
    ap.add_argument("--step-targets", default="",
                    help="records beside chats once per step latency target, in one model load: e.g. 30ms,2x,off "
                         "(max_step_ms 30; max_step_decode_ratio 2; neither, the long-prefill share decides); "
                         "default: the levers' defaults; the profile runs under the first")
    ap.add_argument("--profile-mixed", action="store_true", help="profile steps with a long prefill beside chats")
    ap.add_argument("--load-format", default="auto", choices=("auto", "random"),
                    help="random: GPTQ-Int8 weights made on the device (no weights written to disk)")
    ap.add_argument("--dir", default="", help="where model folders are written (default: a temp dir)")
    ap.add_argument("--lever", action="append", default=[], metavar="NAME=VALUE",
                    help="an engine lever for every model (repeatable), e.g. piecewise_graph_max_rows=512")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the engine's start-up: memory plan, graphs
    if args.smoke:
        args.presets, args.lengths, args.counts, args.chats, args.chunk = "tiny", "1024,1280", "2,1", 2, 512
        args.chat_prompt, args.chat_window = 16, 1.0
    elif not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --smoke on CPU")
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.counts = [int(x) for x in args.counts.split(",")]
    if len(args.counts) != len(args.lengths):
        sys.exit("--counts needs one count per --lengths entry")
    root = Path(args.dir or tempfile.mkdtemp(prefix="qv-clef-"))
    rows = []
    for preset in args.presets.split(","):
        if args.smoke:
            model_dir = tiny.make_tiny(root / "tiny", "tiny")
        else:
            layers = args.layers_27b if preset == "27b" else 0
            model_dir = write_model(root, preset, layers, max(args.lengths) + 4096, torch.bfloat16,
                                    weights=args.load_format == "auto")
        rows += bench_model(add_clef(model_dir, preset), preset, args)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.smoke else "cpu"
    print(f"\nClef records through the engine ({device}; chunk {args.chunk}, {args.slots} Clef slots; latency = "
          "submission to answer, queueing included; chats: greedy decode of 2048 tokens, resubmitted)")
    print("| model | record tokens | chats | step target | records | records/s | p50 latency (s) | p95 latency (s) | "
          "chat tok/s | chat ITL p50 (ms) | chat ITL p95 (ms) | restarts | peak GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(table_row(*row))
    print("\n| model | record tokens | step target | chat ITL p95 beside records / alone (<= 2.5x) | records/s beside "
          "chats / alone (>= 0.75x) |")
    print("|---|---|---|---|---|")
    print("\n".join(target_lines(rows)))


if __name__ == "__main__":
    main()
