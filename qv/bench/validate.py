"""`qv validate MODEL_DIR`: the original stack's published gates as one command for anyone who brings
real weights. Each gate passes, fails or is skipped by name with the reason; speed is reported.

- reference: qv's greedy tokens and their log-probabilities against transformers on the same folder
  (teacher-forced on qv's tokens; text prompts, and a picture where the model has a vision tower): max |delta log p| and top-1 agreement outside near ties, under the
  bounds docs/VALIDATION.md publishes for qv's activation dtype.
- retrieval: a code word at the start of a filler prompt (default: the longest the memory plan holds,
  at most 243,173 tokens), reproduced verbatim under greedy decoding; retrieval_depth: facts planted
  at 5 / 50 / 95 % of such a prompt, each reproduced.
- speculation: MTP acceptance length over built-in natural-text passages at k = 3 (the original
  measured 3.6-3.8), and greedy outputs with speculation on equal to speculation off.
- clef: decisions on built-in records against Cloudflare's `systemone()` (clef-finetune, when it is
  installed and the folder is a release) within 0.0093 (the original's bound), and self-consistency:
  a batch equals each record alone, and a repeat is identical.
- repeatability: the same requests twice (greedy and seeded sampling) give the same bits.
- speed: one `qv bench` row per kind (decode at batch 1, a prefill) beside its floor (reported).

The engine and the transformers model are never resident together: qv runs first and keeps what it
produced, then the engine is freed and the oracles load.
"""

from __future__ import annotations

import gc
import json
from dataclasses import asdict
from pathlib import Path

from qv.bench.validate_gates import (GATES, EngineRun, GateResult, ValidateOptions, clef_gate, reference_gate,
                                     speculation_gate, speed_gate)

def _free() -> None:
    import torch

    gc.collect()  # the engine's parts reference each other
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def validate(model_dir: str, opts: ValidateOptions, log=print) -> tuple[dict, list[GateResult]]:
    """(header, one result per gate asked for, in GATES order)."""
    unknown = sorted(set(opts.gates) - set(GATES))
    if unknown:
        raise ValueError(f"unknown gates {unknown}; the gates are {', '.join(GATES)}")
    results: dict[str, GateResult] = {}
    log(f"qv validate: {model_dir}: starting qv (speculation off)")
    run = EngineRun(model_dir, opts, log)
    header = run.header()
    results.update(run.gates())  # retrieval, retrieval_depth, repeatability, and what qv needs for the oracles
    observed = run.observed
    del run
    _free()
    if "reference" in opts.gates:
        log("qv validate: reference: transformers on the same folder")
        results["reference"] = reference_gate(model_dir, observed)
        _free()
    if "clef" in opts.gates:
        results["clef"] = clef_gate(model_dir, observed, log)
        _free()
    if "speculation" in opts.gates:
        log(f"qv validate: speculation: qv with MTP drafts, k = {opts.spec_k}")
        results["speculation"] = speculation_gate(model_dir, opts, observed)
        _free()
    if "speed" in opts.gates:
        log("qv validate: speed: qv bench, one row per kind")
        results["speed"] = speed_gate(model_dir, opts)
        _free()
    return header, [results[g] for g in GATES if g in opts.gates]


def failed(results: list[GateResult]) -> list[str]:
    return [r.gate for r in results if r.status == "fail"]


def table(header: dict, results: list[GateResult]) -> str:
    """The markdown table `qv validate` prints."""
    lines = [f"qv validate {header['model']} (qv {header['version']}, {header['device']}, {header['dtype']})", "",
             "| gate | status | measured | bound | detail |", "| --- | --- | --- | --- | --- |"]
    for r in results:
        cells = (r.gate, r.status.upper(), r.measured, r.bound, r.detail)
        lines.append("| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
    bad = failed(results)
    lines += ["", f"FAILED: {', '.join(bad)}" if bad else "every gate taken passed"]
    return "\n".join(lines)


def write_json(path: str, header: dict, results: list[GateResult]) -> None:
    Path(path).write_text(json.dumps({**header, "gates": [asdict(r) for r in results],
                                      "failed": failed(results)}, indent=1))


__all__ = ["GATES", "GateResult", "ValidateOptions", "failed", "table", "validate", "write_json"]
