"""`qv serve | generate | bench | make-tiny | quantize | doctor` - thin argument parsing over the package."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from qv.config import EngineConfig


def _add_lever_flags(p: argparse.ArgumentParser) -> None:
    """One --flag per engine lever (dashes for underscores); unset flags leave env/defaults alone."""
    for f in dataclasses.fields(EngineConfig):
        if f.name == "model":
            continue
        flag = "--" + f.name.replace("_", "-")
        p.add_argument(flag, dest=f.name, default=None, help=f"{f.metadata['doc']} (env {f.metadata['env']})")


def _overrides(args: argparse.Namespace) -> dict:
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    return {k: v for k, v in vars(args).items() if k in names and v is not None}


def cmd_serve(args: argparse.Namespace) -> int:
    from qv.server.app import serve

    overrides = _overrides(args)
    if args.model:
        overrides["model"] = args.model
    serve(EngineConfig.from_env(**overrides))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from qv.llm import LLM
    from qv.engine.request import SamplingParams

    overrides = _overrides(args)
    overrides.pop("model", None)
    llm = LLM(model=args.model, **overrides)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed_sample)
    for out in llm.generate(args.prompt, params):
        print(out.outputs[0].text)
    return 0


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def cmd_bench(args: argparse.Namespace) -> int:
    import json

    from qv.bench import BenchSpec, bench, markdown

    spec = BenchSpec(batch_sizes=_int_list(args.batch_sizes), batch_context=args.batch_context,
                     contexts=_int_list(args.contexts), prefill_lengths=_int_list(args.prefill_lengths),
                     steps=args.steps, warmup=args.warmup, profile=args.profile)
    report = bench(spec, _overrides(args), model=args.model, preset=args.preset)
    print(markdown(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def cmd_make_tiny(args: argparse.Namespace) -> int:
    from qv.model.tiny import make_tiny

    path = make_tiny(args.out, args.preset, args.seed, args.mtp)
    if args.fit_mtp:
        from qv.spec.fit import fit_mtp_head

        fit_mtp_head(path, steps=args.fit_mtp)
    if args.gptq:
        from qv.model.quantize import quantize_checkpoint

        quantize_checkpoint(path, path, bits=8, group_size=args.group_size, sym=True, in_place=True)
    print(path)
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    from qv.model.quantize import quantize_checkpoint

    quantize_checkpoint(args.src, args.out, bits=args.bits, group_size=args.group_size, sym=not args.asym,
                        exclude=args.exclude)
    print(args.out)
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from qv.doctor import report

    print(report())
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qv", description="Serve hybrid Qwen3.5-family models.")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="OpenAI-compatible server (+ /v1/systemone) on MODEL or the tiny default")
    s.add_argument("model", nargs="?", default=None, help="checkpoint folder (default: $QV_MODEL or the tiny model)")
    _add_lever_flags(s)
    s.set_defaults(fn=cmd_serve)

    g = sub.add_parser("generate", help="offline generation through qv.LLM")
    g.add_argument("prompt")
    g.add_argument("--model", default=None)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--seed-sample", type=int, default=None, help="per-request sampling seed")
    _add_lever_flags(g)
    g.set_defaults(fn=cmd_generate)

    b = sub.add_parser("bench", help="whole-model benchmark: decode ms/step and prefill s, each beside its floor")
    b.add_argument("model", nargs="?", default=None, help="checkpoint folder (default: $QV_MODEL or the tiny model)")
    b.add_argument("--preset", default=None, help="a config.json of this shape with random weights (27b, 0.5b, tiny, ...)")
    b.add_argument("--batch-sizes", default="1,8,16,32,64", help="decode rows at these batch sizes")
    b.add_argument("--batch-context", type=int, default=1024, help="prompt tokens of each sequence in those rows")
    b.add_argument("--contexts", default="32768,131072", help="decode rows at batch 1 from these contexts")
    b.add_argument("--prefill-lengths", default="32768,131072,250000", help="prefill rows of these prompt lengths")
    b.add_argument("--steps", type=int, default=32, help="timed decode steps per row")
    b.add_argument("--warmup", type=int, default=4, help="decode steps before timing")
    b.add_argument("--json", default=None, metavar="OUT", help="also write the report as JSON")
    b.add_argument("--profile", action="store_true",
                   help="per-kernel table of one decode step at the smallest and the largest batch")
    _add_lever_flags(b)
    b.set_defaults(fn=cmd_bench)

    t = sub.add_parser("make-tiny", help="write a deterministic tiny HF-format checkpoint folder")
    t.add_argument("out")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--preset", default="tiny")
    t.add_argument("--mtp", action="store_true", help="include mtp.* tensors")
    t.add_argument("--fit-mtp", type=int, default=0, metavar="STEPS", help="self-distil the MTP head (needs --mtp)")
    t.add_argument("--gptq", action="store_true", help="store linears as GPTQ-int8 (RTN)")
    t.add_argument("--group-size", type=int, default=16, help="GPTQ group size (16 divides every tiny preset's dims)")
    t.set_defaults(fn=cmd_make_tiny)

    q = sub.add_parser("quantize", help="write a GPTQ-Int8 checkpoint (round-to-nearest)")
    q.add_argument("src")
    q.add_argument("out")
    q.add_argument("--bits", type=int, default=8)
    q.add_argument("--group-size", type=int, default=128)
    sym = q.add_mutually_exclusive_group()
    sym.add_argument("--sym", action="store_true", default=True)
    sym.add_argument("--asym", action="store_true")
    q.add_argument("--exclude", action="append", default=[], metavar="REGEX",
                   help="module name regex to keep unquantized (repeatable)")
    q.set_defaults(fn=cmd_quantize)

    d = sub.add_parser("doctor", help="print devices, toolchain and which kernels qv would use")
    d.set_defaults(fn=cmd_doctor)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
