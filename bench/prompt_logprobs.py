"""Prompt logprobs: the device memory a long prompt's prompt_logprobs take beyond the same request
without them, which qv bounds by computing the logits a slice of rows at a time.

    python bench/prompt_logprobs.py                 # GPU: 27B-shaped (4 of 64 layers), a 32K-token prompt
    python bench/prompt_logprobs.py --smoke         # CPU: tiny model, short prompt (checks the script works)

The model is random GPTQ-Int8 weights in the 27B's shapes with its 248,320-token vocabulary (the
lm_head and the logits rows are what prompt logprobs cost), 3 GDN layers and 1 attention layer:
the layer count moves the forward's activations, which both runs share. Each run is one request of
max_tokens=1 after a warm-up; "peak extra" is torch.cuda.max_memory_allocated during the request
minus the memory allocated before it (KV cache and weights excluded). For scale the table also
shows what full-vocabulary fp32 logits of one prefill chunk would take.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qv import LLM, SamplingParams  # noqa: E402
from qv.bench.presets import write_preset  # noqa: E402
from qv.engine.prompt_logprobs import BYTES_PER_LOGIT, slice_rows  # noqa: E402

MIB = 1 << 20


def write_model(root: Path, preset: str, layers: int, max_len: int) -> Path:
    """A config-only folder (load_format=random) of `preset` cut to `layers` layers, every 4th attention."""
    out = write_preset(preset, root / f"{preset}-{layers}l")
    config = json.loads((out / "config.json").read_text())
    config["num_hidden_layers"] = layers
    config["layer_types"] = ["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(layers)]
    config["max_position_embeddings"] = max_len
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def measure(llm: LLM, prompt: list[int], top_n: int | None) -> dict:
    """One request's peak extra device memory, its time and the entries it returned."""
    cuda = llm.engine.runner.device.type == "cuda"
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=top_n)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t = time.perf_counter()
    out = llm.generate({"prompt_token_ids": prompt}, params)[0]
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t
    extra = torch.cuda.max_memory_allocated() - base if cuda else None
    entries = len(out.prompt_logprobs) if out.prompt_logprobs is not None else 0
    if top_n is not None and entries != len(prompt):
        raise RuntimeError(f"prompt_logprobs has {entries} entries for a {len(prompt)}-token prompt")
    return {"extra": extra, "wall": wall, "entries": entries}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU check: tiny model, short prompt")
    ap.add_argument("--preset", default="27b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=32768)
    ap.add_argument("--top", type=int, default=5, help="prompt_logprobs of the measured request")
    ap.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens (prefill chunk)")
    ap.add_argument("--dir", default="", help="where the config-only model folder goes (default: a temp dir)")
    args = ap.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="qv-plp-"))
    if args.smoke:
        from qv.model.tiny import make_tiny

        folder = root / "tiny"
        if not (folder / "config.json").is_file():
            make_tiny(folder, "tiny")
        levers, n = dict(device="cpu", max_num_batched_tokens=64), 300
    else:
        folder = write_model(root, args.preset, args.layers, args.prompt_tokens + 64)
        levers = dict(load_format="random", kv_dtype="int8", max_num_batched_tokens=args.chunk,
                      max_model_len=args.prompt_tokens + 64, max_num_seqs=8)
        n = args.prompt_tokens
    llm = LLM(model=str(folder), **levers)
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)
    prompt = [rng.randrange(vocab) for _ in range(n)]
    warm = [rng.randrange(vocab) for _ in range(min(n, 2 * levers["max_num_batched_tokens"] + 5))]
    for top in (None, args.top):  # every kernel path compiled before anything is measured
        measure(llm, warm, top)
    runs = {"without": measure(llm, prompt, None), f"prompt_logprobs={args.top}": measure(llm, prompt, args.top)}
    chunk = levers["max_num_batched_tokens"]
    rows = min(slice_rows(vocab), chunk)
    print(f"\n{folder.name}: vocab {vocab:,}, {n:,}-token prompt, prefill chunk {chunk}, logits slice {rows} rows")
    print(f"{'request':<22}{'peak extra MiB':>16}{'wall s':>10}{'entries':>10}")
    for name, r in runs.items():
        extra = "n/a (CPU)" if r["extra"] is None else f"{r['extra'] / MIB:.1f}"
        print(f"{name:<22}{extra:>16}{r['wall']:>10.2f}{r['entries']:>10,}")
    a, b = runs["without"]["extra"], runs[f"prompt_logprobs={args.top}"]["extra"]
    if a is not None:
        print(f"{'difference':<22}{(b - a) / MIB:>16.1f}")
    print(f"\nfor scale: one slice's logits, log-softmax and rank mask {rows * vocab * BYTES_PER_LOGIT / MIB:.1f} MiB; "
          f"full-vocabulary fp32 logits of one {chunk}-row chunk {chunk * vocab * 4 / MIB:.1f} MiB")


if __name__ == "__main__":
    main()
