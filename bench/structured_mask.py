"""What a structured output's token mask costs a decode step at batch 32, beside the step itself: the host
fills each constrained row's bitmask from its xgrammar matcher, the bitmask goes to the device, and the
sampler sets the refused logits to -inf (qv/engine/structured.py, qv/engine/sampler.py).

    python bench/structured_mask.py [--batch 32] [--vocab 248320] [--step-ms 22.92] [--json OUT]

The vocabulary is synthetic (no Qwen tokenizer is on the device): `--vocab` byte-level tokens, the 256
bytes then random 2-8 byte pieces of JSON-ish text, so the grammar's token tables have the real size. The
grammar is the 20-schema suite's nested object (tests/server); each row's matcher is advanced a few tokens
into the object so the mask is not the start state. The step it is compared with is `qv bench --preset
27b` at the same batch (22.92 ms at batch 32, docs/BENCHMARKS.md), or --step-ms.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["id", "name", "tags", "point"],
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 10000},
                         "name": {"type": "string", "maxLength": 12},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
                         "point": {"type": "object", "required": ["x", "y"], "additionalProperties": False,
                                   "properties": {"x": {"type": "number"}, "y": {"type": "number"}}}}}
PIECES = '{}[]":,. 0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_-'


def synthetic_vocab(size: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    vocab = [bytes([i]) for i in range(256)]
    seen = set(vocab)
    while len(vocab) < size:
        piece = "".join(rng.choice(PIECES) for _ in range(rng.randint(2, 8))).encode()
        if piece not in seen:
            seen.add(piece)
            vocab.append(piece)
    return vocab


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--step-ms", type=float, default=22.92)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import xgrammar as xgr

    from qv.engine.structured import apply_bitmask

    vocab = synthetic_vocab(args.vocab)
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.BYTE_FALLBACK, vocab_size=args.vocab, stop_token_ids=[0])
    t0 = time.perf_counter()
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
    compile_s = time.perf_counter() - t0
    prefix = [vocab.index(t) for t in (b"{", b'"', b"i", b"d", b'"', b":")]
    matchers = []
    for _ in range(args.batch):
        m = xgr.GrammarMatcher(compiled)
        for tok in prefix:
            assert m.accept_token(tok)
        matchers.append(m)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    mask = xgr.allocate_token_bitmask(args.batch, args.vocab)
    logits = torch.randn(args.batch, args.vocab, device=device)
    rows = list(range(args.batch))
    fill, copy, apply = [], [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(mask, i)
        t1 = time.perf_counter()
        on_device = mask.to(device, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        apply_bitmask(logits, (on_device, rows))
        if device.type == "cuda":
            torch.cuda.synchronize()
        t3 = time.perf_counter()
        fill.append(t1 - t0)
        copy.append(t2 - t1)
        apply.append(t3 - t2)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    parts = {"fill (host, xgrammar)": med(fill), "copy to the device": med(copy), "apply (device)": med(apply)}
    total = sum(parts.values())
    print(f"structured-output mask at batch {args.batch}, vocabulary {args.vocab:,} ({device}); schema compiled "
          f"in {compile_s:.2f} s\n")
    print("| part | ms | share of a decode step |\n| --- | ---: | ---: |")
    for name, s in parts.items():
        print(f"| {name} | {s * 1e3:.3f} | {s * 1e3 / args.step_ms:.1%} |")
    print(f"| **total** | **{total * 1e3:.3f}** | **{total * 1e3 / args.step_ms:.1%}** (target <= 5%; step "
          f"{args.step_ms} ms) |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"batch": args.batch, "vocab": args.vocab, "device": str(device), "compile_s": compile_s,
                       "parts_s": parts, "total_s": total, "step_ms": args.step_ms}, f, indent=1)


if __name__ == "__main__":
    main()
