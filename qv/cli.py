"""`qv serve | generate | bench [serve] | make-tiny | quantize | kernels | doctor` - thin argument parsing over the
package.

Errors a user can act on (ConfigError, CheckpointError, StartupError, ...) print as one line with exit
status 2; `--debug` shows their traceback instead."""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from typing import Literal, get_args, get_origin

from qv.cli_vllm import add_engine_aliases, add_server_aliases
from qv.config import ConfigError, EngineConfig, env_name, expected, kernel_cache_dirs, state_path
from qv.errors import InvalidRequestError, StartupError
from qv.version import __version__

# exceptions whose message is the whole story, by module: matched only once their module was imported
USER_ERRORS = {"qv.model.weights": "CheckpointError", "qv.clef.adapters": "ClefLayoutError",
               "qv.kernels.ahead_of_time": "AheadOfTimeError"}
SERVE_EPILOG = """\
Levers come from, later winning: their defaults, QV_* environment variables, the --env-file (a levers file:
KEY=value lines, # comments, optional quotes and `export `; every key must be a QV_* lever, once), then
these flags. See docs/LEVERS.md. Before loading, qv serve refuses (exit 2, one line) a busy port or a memory
plan that does not fit the device's free memory; --dry-run prints the levers, where each came from and the
plan, and exits (0, or 2 with the reason a start would be refused). vLLM's spellings of the levers work too
(--enforce-eager, -tp, --kv-cache-dtype, --speculative-config, ...); one qv has no equivalent of says so."""
# levers only the server reads: `generate` and `bench` do not take their flags
SERVER_LEVERS = {"host", "port", "served_model_name", "api_key", "metrics_public", "enable_thinking", "max_body_bytes",
                 "max_waiting", "max_prompts_per_request", "max_stop_strings", "body_read_timeout_s",
                 "shutdown_grace_s", "log_level", "log_stats", "log_stats_interval_s", "access_log",
                 "media_allowed_domains", "media_allowed_networks", "media_local_dir", "media_timeout_s",
                 "media_max_bytes", "api_key_scope", "allowed_origins", "allowed_methods", "allowed_headers",
                 "allow_credentials", "trust_request_chat_template", "header_read_timeout_s", "keep_alive_timeout_s",
                 "max_connections", "stream_stall_timeout_s", "root_path", "allow_runtime_lora_updating"}
# a lever flag's extra spellings (vLLM's short ones)
SHORT_FLAGS = {"tensor_parallel_size": ["-tp"]}


class _CommandParser(argparse.ArgumentParser):
    """A subcommand's parser: an unknown flag is its own error ("qv serve: error: ..."), with the nearest
    flag it does take, instead of the top-level parser's bare "unrecognized arguments"."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error("unrecognized arguments: " + " ".join(extras) + self._did_you_mean(extras))
        return namespace, extras

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n({self.prog} --help lists its flags)\n")

    def _did_you_mean(self, extras: list[str]) -> str:
        known = [o for a in self._actions for o in a.option_strings]
        for arg in extras:
            if arg.startswith("-"):
                near = difflib.get_close_matches(arg.split("=", 1)[0], known, n=1, cutoff=0.6)
                if near:
                    return f" (did you mean {near[0]}?)"
        return ""


class _JoinNames(argparse.Action):
    """--served-model-name a b (vLLM's, space-separated) or a,b (qv's): one comma-separated lever value."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, ",".join(values))


class _AppendLoraModules(argparse.Action):
    """--lora-modules a=p b=q, repeatable, each entry name=path or vLLM's JSON object: one JSON list lever value."""

    def __call__(self, parser, namespace, values, option_string=None):
        have = json.loads(getattr(namespace, self.dest) or "[]")
        setattr(namespace, self.dest, json.dumps(have + list(values)))


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in --help, except where there is none to show (lever flags say theirs in the text)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False, [], argparse.SUPPRESS) or not action.help:
            return action.help or ""
        return super()._get_help_string(action)


def _metavar(name: str) -> str:
    kind = EngineConfig.model_fields[name].annotation
    if get_origin(kind) is Literal:
        return "{" + ",".join(get_args(kind)) + "}"
    return {bool: "{1,0}", int: "N", float: "X"}.get(kind, "TEXT")


def _add_lever_flags(p: argparse.ArgumentParser, server: bool = False) -> None:
    """One --flag per engine lever (dashes for underscores; the server's levers on `serve` only); unset flags
    leave the env file, the environment and the defaults alone, so their argparse default is None and the
    lever's own default is in the text. vLLM's spellings follow (qv/cli_vllm.py)."""
    g = p.add_argument_group("levers (docs/LEVERS.md)")
    for name, info in EngineConfig.model_fields.items():
        if name == "model" or (name in SERVER_LEVERS and not server):
            continue
        default = "unset" if info.default is None else repr(info.default)
        metavar = _metavar(name)
        takes = f" Takes {expected(name)}." if metavar in ("N", "X") or info.json_schema_extra.get("expect") else ""
        text = f"{info.description}{takes} (env {env_name(name)}, default {default})"
        extra = {"nargs": "+", "action": _JoinNames} if name == "served_model_name" else {}
        if name == "lora_modules":
            extra = {"nargs": "+", "action": _AppendLoraModules}
        g.add_argument("--" + name.replace("_", "-"), *SHORT_FLAGS.get(name, []), dest=name, default=None,
                       metavar=metavar, help=text.replace("%", "%%"), **extra)
    add_engine_aliases(p)
    if server:
        add_server_aliases(p)


def _add_model(p: argparse.ArgumentParser) -> None:
    """The checkpoint folder, as a positional or vLLM's --model (`_model` reconciles them)."""
    p.add_argument("model_dir", nargs="?", default=None, metavar="MODEL",
                   help="checkpoint folder (default: $QV_MODEL or the tiny model)")
    p.add_argument("--model", dest="model_flag", default=None, metavar="MODEL", help="the same, as vLLM spells it")


def _model(args: argparse.Namespace) -> str | None:
    if args.model_dir and args.model_flag and args.model_dir != args.model_flag:
        raise ConfigError(f"two models named: {args.model_dir} (positional) and --model {args.model_flag}")
    return args.model_dir or args.model_flag


def _overrides(args: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(args).items() if k in EngineConfig.model_fields and v is not None}


def cmd_serve(args: argparse.Namespace) -> int:
    from qv.engine.preflight import preflight

    overrides = _overrides(args)
    if _model(args):
        overrides["model"] = _model(args)
    cfg, origins = EngineConfig.resolve(env_file=args.env_file, **overrides)
    check = preflight(cfg)
    if args.dry_run:
        print(dry_run_text(cfg, origins, check))
    if check.problems:
        raise StartupError("; ".join(check.problems))
    if args.dry_run:
        return 0
    from qv.server.app import serve

    try:
        serve(cfg)
    except SystemExit as e:  # serve() ends an engine that did not start with its message
        if not isinstance(e.code, str):
            raise
        print(e.code, file=sys.stderr)
        return 2
    return 0


def dry_run_text(cfg: EngineConfig, origins: dict[str, str], check) -> str:
    """What `qv serve --dry-run` prints: every lever with its value and where it came from, where the
    model, caches and state live, and the memory plan (weights counted from the config, none loaded)."""
    from qv.engine.preflight import gib

    lines = ["qv serve --dry-run: nothing loaded", "levers (value, and where it came from when not the default):"]
    width = max(len(n) for n in EngineConfig.model_fields)
    for name in EngineConfig.model_fields:
        value = getattr(cfg, name)
        shown = "***" if name == "api_key" and value else repr(value)
        origin = {"argument": "flag"}.get(origins.get(name), origins.get(name))
        lines.append(f"  {name:<{width}} {shown}" + (f"   <- {origin}" if origin else ""))
    lines.append(f"model folder: {check.model_dir}")
    lines.append(f"device: {check.device}, activations {str(check.dtype).removeprefix('torch.')}")
    lines.append(f"state dir: {state_path(cfg.state_dir)} (" +
                 ", ".join(f"{k}={v}" for k, v in kernel_cache_dirs(cfg.state_dir).items()) + ")")
    if check.plan is not None:
        lines.append(f"{check.plan.summary()} (weights counted from the config)")
    if check.fit_hint:
        lines.append(check.fit_hint)
    where = ("free on the planned device (device_memory_bytes)" if cfg.device_memory_bytes else
             "free on the GPU" if check.device.type == "cuda" else "available on the host")
    lines.append(f"needs {gib(check.needed_bytes)} of the {gib(check.free_bytes)} {where}")
    lines.append("a start would be refused: " + "; ".join(check.problems) if check.problems else
                 f"checks: port {cfg.port} on {cfg.host} is free, the plan fits")
    return "\n".join(lines)


def cmd_generate(args: argparse.Namespace) -> int:
    from qv.llm import LLM
    from qv.engine.request import SamplingParams

    overrides = _overrides(args)
    overrides.pop("model", None)
    llm = LLM(model=_model(args), **overrides)
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
                     steps=args.steps, warmup=args.warmup, profile=args.profile, linears=args.linears,
                     attention=args.attention)
    report = bench(spec, _overrides(args), model=_model(args), preset=args.preset)
    print(markdown(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from qv.bench.validate import GATES, ValidateOptions, failed, table, validate, write_json

    gates = tuple(g.strip() for g in args.gates.split(",") if g.strip()) if args.gates else GATES
    opts = ValidateOptions(gates=gates, retrieval_tokens=args.retrieval_tokens, code_word=args.code_word,
                           min_acceptance=args.min_acceptance, speed_prefill=args.speed_prefill,
                           levers={k: v for k, v in _overrides(args).items() if k != "model"})
    header, results = validate(_model(args), opts, log=lambda line: print(line, file=sys.stderr, flush=True))
    print(table(header, results))
    if args.json:
        write_json(args.json, header, results)
    return 1 if failed(results) else 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    import asyncio
    import json

    from qv.bench.serve import ServeSpec, drive, serve_markdown, started_server

    try:
        spec = ServeSpec(chats=args.chats, records=args.records, stream_fraction=args.stream_fraction,
                         hangup_fraction=args.hangup_fraction, prompt_len=args.prompt_len, output_len=args.output_len,
                         record_lengths=_int_list(args.record_lengths), request_rate=args.request_rate,
                         concurrency=args.concurrency, duration_s=args.duration, seed=args.seed,
                         model_name=args.served_model or "", settle_s=args.settle, probes=args.probes)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if args.url:
        if args.model or args.preset:
            raise ConfigError("qv bench serve: --url targets a running server; --model and --preset start one")
        report = asyncio.run(drive(args.url, spec, args.api_key))
    else:
        with started_server(args.model, args.preset, args.serve_arg, args.startup_timeout) as url:
            report = asyncio.run(drive(url, spec, args.api_key))
    print(serve_markdown(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def build_bench_serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qv bench serve", formatter_class=_Formatter, description=(
        "Drive a qv server over HTTP with chats and Clef records together (like `vllm bench serve`): it starts "
        "`qv serve` on a free loopback port (--model, --preset, or the tiny model) or targets --url, and prints "
        "TTFT, ITL and end-to-end percentiles, throughputs, errors and the server's /metrics deltas."))
    p.add_argument("--debug", action="store_true", help="show the traceback of an error, not just its message")
    p.add_argument("--url", default=None, help="a running server (http://HOST:PORT); default: start one")
    p.add_argument("--model", default=None, help="checkpoint folder of the server to start (default: tiny model)")
    p.add_argument("--preset", default=None, help="start the server on this preset's shapes with random weights")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="pass ARG to the qv serve it starts (repeatable, e.g. --serve-arg=--max-step-ms=50)")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds the server may take to start")
    p.add_argument("--api-key", default=None, help="Bearer key of the server")
    p.add_argument("--served-model", default=None, help="model name the chats ask for (default: the first served)")
    p.add_argument("--chats", type=int, default=4, help="chat clients (with --request-rate: the chat share)")
    p.add_argument("--records", type=int, default=2, help="record clients (with --request-rate: the record share)")
    p.add_argument("--stream-fraction", type=float, default=0.5, help="share of chats that stream")
    p.add_argument("--hangup-fraction", type=float, default=0.0,
                   help="share of streamed chats whose client hangs up mid-stream")
    p.add_argument("--prompt-len", type=int, default=64, help="words of each chat prompt")
    p.add_argument("--output-len", type=int, default=32, help="tokens each chat generates (ignore_eos)")
    p.add_argument("--record-lengths", default="256", help="words of a record's state, one drawn per record")
    p.add_argument("--request-rate", type=float, default=0.0, help="Poisson arrivals per second; 0: closed loop")
    p.add_argument("--concurrency", type=int, default=0,
                   help="most requests in flight with --request-rate (0: chats + records)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds new requests are sent")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and the mix")
    p.add_argument("--settle", type=float, default=0.0,
                   help="seconds into the load at which the server's memory counts as settled (0: a quarter of "
                        "--duration); the report sets the end against it")
    p.add_argument("--probes", type=int, default=2,
                   help="greedy probe chats sent before the load and after the drain, whose answers must match")
    p.add_argument("--json", default=None, metavar="OUT", help="also write the report as JSON")
    p.set_defaults(fn=cmd_bench_serve, command="bench serve")
    return p


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
    from qv.model.quantize import GPTQOptions, quantize_checkpoint

    gptq = GPTQOptions(args.calibration, args.num_samples, args.seq_len, args.damp, not args.no_act_order,
                       not args.dynamic_groups, args.device, args.seed)
    quantize_checkpoint(args.src, args.out, bits=args.bits, group_size=args.group_size, sym=not args.asym,
                        exclude=args.exclude, method=args.method, gptq=gptq, lm_head=args.lm_head,
                        log=lambda m: print(m, file=sys.stderr))
    print(args.out)
    return 0


def cmd_kernels(args: argparse.Namespace) -> int:
    from qv.kernels import ahead_of_time

    arch = ahead_of_time.parse_arch(args.arch)
    reports = ahead_of_time.compile_all(arch, args.out, EngineConfig.from_env().ptxas)
    print(f"the sm70 chain's kernels compiled for sm_{arch} (NVRTC 12 -> PTX -> ptxas -v):")
    print(ahead_of_time.table(reports))
    if args.out:
        print(f"PTX of each kernel written to {args.out}")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from qv.doctor import report

    print(report())
    return 0


def _is_user_error(e: BaseException) -> bool:
    if isinstance(e, (ConfigError, StartupError, InvalidRequestError)):
        return True
    return any(isinstance(e, getattr(sys.modules[m], name)) for m, name in USER_ERRORS.items() if m in sys.modules)


def _add_validate(command) -> None:
    """`qv validate`: the gates' options."""
    v = command("validate", "the original's gates on MODEL: transformers reference, retrieval, MTP acceptance, Clef, "
                "repeatability, speed; a table, exit status 1 when a gate fails")
    v.add_argument("model_dir", metavar="MODEL", help="checkpoint folder")
    v.add_argument("--model", dest="model_flag", default=None, help=argparse.SUPPRESS)
    v.add_argument("--gates", default=None, help="comma-separated subset (default: all)")
    v.add_argument("--json", default=None, metavar="OUT", help="also write the results as JSON")
    v.add_argument("--retrieval-tokens", type=int, default=0, help="filler prompt length (0: the longest the plan holds, "
                   "at most 243,173)")
    v.add_argument("--code-word", default=None, help="the planted code word (default: five seeded digits)")
    v.add_argument("--min-acceptance", type=float, default=3.6, help="MTP acceptance length the speculation gate needs")
    v.add_argument("--speed-prefill", type=int, default=8192, help="prompt tokens of the speed gate's prefill row")
    _add_lever_flags(v)
    v.set_defaults(fn=cmd_validate)


def _add_quantize(command) -> None:
    """`qv quantize`: format, grouping and the calibration's options."""
    q = command("quantize", "write a GPTQ-Int8 or GPTQ-Int4 checkpoint (calibrated GPTQ or round-to-nearest)")
    q.add_argument("src", help="checkpoint folder to quantize")
    q.add_argument("out", help="folder to write")
    q.add_argument("--bits", type=int, default=8, choices=(8, 4), help="bits per weight: 8 (GPTQ-Int8) or 4")
    q.add_argument("--group-size", type=int, default=128, help="input rows per scale group (-1: one group)")
    sym = q.add_mutually_exclusive_group()
    sym.add_argument("--sym", action="store_true", default=True, help="symmetric codes (zero 128, or 8 at 4 bits)")
    sym.add_argument("--asym", action="store_true", help="asymmetric codes (a zero point per group)")
    q.add_argument("--exclude", action="append", default=[], metavar="REGEX",
                   help="module name regex to keep unquantized (repeatable)")
    q.add_argument("--method", default="gptq", choices=("gptq", "rtn"),
                   help="gptq: calibrated, layer by layer (Hessian error compensation); rtn: round-to-nearest")
    q.add_argument("--calibration", default=None, metavar="FILE",
                   help="calibration text: a .jsonl file ({\"text\": ...} a line) or a text file; default: built-in")
    q.add_argument("--num-samples", type=int, default=128, help="calibration sequences (gptq)")
    q.add_argument("--seq-len", type=int, default=512, help="tokens per calibration sequence (gptq)")
    q.add_argument("--damp", type=float, default=0.01, help="damping: share of the mean Hessian diagonal (gptq)")
    q.add_argument("--no-act-order", action="store_true", help="quantize columns in order, not by activation size")
    q.add_argument("--dynamic-groups", action="store_true",
                   help="groups follow the activation order (permuted g_idx, desc_act): a little more accurate, but "
                   "slower kernels and no tensor-parallel row shards; default: static groups, g_idx k // group")
    q.add_argument("--device", default="auto", help="where the calibration runs: auto, cpu, cuda, cuda:N")
    q.add_argument("--seed", type=int, default=0, help="seed of the calibration windows")
    q.add_argument("--lm-head", action="store_true",
                   help="also write the lm_head as int8 with one scale per vocabulary row")
    q.set_defaults(fn=cmd_quantize)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qv", description="Serve hybrid Qwen3.5-family models.", formatter_class=_Formatter)
    p.add_argument("--debug", action="store_true", help="show the traceback of an error, not just its message")
    p.add_argument("--version", action="version", version=f"qv {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_CommandParser)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show the traceback of an error, not just its message")

    def command(name: str, help: str, **kw) -> argparse.ArgumentParser:
        # no abbreviations: a prefix of one lever must not silently set another (--api-key of --api-key-scope)
        return sub.add_parser(name, help=help, description=help, parents=[common], formatter_class=_Formatter,
                              allow_abbrev=False, **kw)

    s = command("serve", "OpenAI-compatible server (+ /v1/systemone) on MODEL or the tiny default",
                epilog=SERVE_EPILOG)
    _add_model(s)
    s.add_argument("--env-file", default=None, metavar="FILE", help="levers file (KEY=value lines of QV_* levers)")
    s.add_argument("--dry-run", action="store_true",
                   help="print the resolved levers and the memory plan, load nothing, exit")
    _add_lever_flags(s, server=True)
    s.set_defaults(fn=cmd_serve)

    g = command("generate", "offline generation through qv.LLM")
    _add_model(g)
    g.add_argument("prompt", help="the prompt text")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    g.add_argument("--max-tokens", type=int, default=32, help="most tokens to generate")
    g.add_argument("--seed-sample", type=int, default=None, help="per-request sampling seed")
    _add_lever_flags(g)
    g.set_defaults(fn=cmd_generate)

    b = command("bench", "whole-model benchmark: decode ms/step and prefill s, each beside its floor "
                "(`qv bench serve --help`: chats and records against a server over HTTP)")
    _add_model(b)
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
    b.add_argument("--linears", action="store_true",
                   help="also each GPTQ linear at M = 1..8192 beside cuBLAS bf16 and the weight-read floor")
    b.add_argument("--attention", action="store_true",
                   help="also a prompt chunk over a 32K and a 128K int8 prefix beside SDPA and the FLOP floor")
    _add_lever_flags(b)
    b.set_defaults(fn=cmd_bench)

    _add_validate(command)

    t = command("make-tiny", "write a deterministic tiny HF-format checkpoint folder")
    t.add_argument("out", help="folder to write")
    t.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    t.add_argument("--preset", default="tiny", help="shape preset (qv/model/tiny.py PRESETS)")
    t.add_argument("--mtp", action="store_true", help="include mtp.* tensors")
    t.add_argument("--fit-mtp", type=int, default=0, metavar="STEPS", help="self-distil the MTP head (needs --mtp)")
    t.add_argument("--gptq", action="store_true", help="store linears as GPTQ-int8 (RTN)")
    t.add_argument("--group-size", type=int, default=16, help="GPTQ group size (16 divides every tiny preset's dims)")
    t.set_defaults(fn=cmd_make_tiny)

    _add_quantize(command)

    k = command("kernels", "compile every sm70 kernel ahead of time (NVRTC 12 and ptxas, no GPU needed) and print "
                "its registers, shared memory, spills and m8n8k4 MMAs")
    k.add_argument("--arch", default="sm_70", help="GPU architecture to compile for")
    k.add_argument("--out", default=None, metavar="DIR", help="write each kernel's PTX there as <kernel>.ptx")
    k.set_defaults(fn=cmd_kernels)

    d = command("doctor", "print versions, devices, the CUDA toolchain and which kernels qv would use")
    d.set_defaults(fn=cmd_doctor)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["bench", "serve"]:  # a sub-mode: `qv bench` itself takes an optional model folder
        args = build_bench_serve_parser().parse_args(argv[2:])
    else:
        args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except Exception as e:
        if args.debug or not _is_user_error(e):
            raise
        print(f"qv {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
