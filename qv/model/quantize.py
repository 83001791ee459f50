"""`qv quantize`: write a GPTQ-Int8 or GPTQ-Int4 checkpoint in the standard layout that vLLM,
transformers/GPTQModel and exllama read: checkpoint_format "gptq" (v1, zero stored minus one), P = 32 / bits
codes per int32: qweight int32 [K/P, N], qzeros int32 [K/g, N/P], scales fp16 [K/g, N], g_idx int32 [K].
method "gptq" (the default) calibrates the decoder layers' linears layer by layer (qv/model/gptq.py);
"rtn" rounds every weight to nearest. lm_head=True also writes the lm_head as int8 with one scale per
vocabulary row (a `+:` dynamic rule: bits 8, group_size -1), the layout qv's QV_LM_HEAD_INT8 makes at load.

Which modules are quantized: every 2-D `<module>.weight` whose HF module name (e.g.
`model.language_model.layers.3.mlp.down_proj`) is not matched (`re.match`) by DEFAULT_EXCLUDE or
by a user `--exclude` regex. Everything else is copied unchanged: 1-D/3-D tensors (norms,
conv1d, A_log, dt_bias) are never candidates. Each excluded 2-D module gets a `"-:<regex>"`
entry in `quantization_config.dynamic` (matching both its HF name and its vLLM name) and is
listed in `modules_to_not_convert`, so any reader keeps it dense.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from qv.errors import ConfigError
from qv.kernels.linear import pack_nibbles
from qv.model.gptq import QuantizedWeight, quant_params
from qv.model.lm_head_int8 import quantize_rows_int8
from qv.model.weights import FUSED, index_checkpoint, vllm_names
from qv.model_config import ModelConfig

# Kept dense by default (re.match against the HF module name), and why:
DEFAULT_EXCLUDE = (
    r".*embed_tokens$",  # embeddings are a row gather, not a matmul
    r"(.*\.)?lm_head$",  # logits stay full precision unless --lm-head (vLLM's quantization_config.lm_head)
    r".*\.linear_attn\.in_proj_[ab]$",  # GDN beta/decay gates: [Hv, H], too small to pay, precision-critical
    r".*\.linear_attn\.conv1d$",  # depthwise conv, not a linear
    r".*norm$",  # RMSNorm weights (1-D anyway)
    r"model\.visual\.",  # the vision tower stays dense, like Qwen's own GPTQ releases
)
LM_HEAD_EXCLUDE = DEFAULT_EXCLUDE[1]
SHARD_BYTES = 4 << 30


METHODS = ("gptq", "rtn")


@dataclass
class GPTQOptions:
    """Calibrated GPTQ's settings (qv/model/gptq.py): calibration text (a .txt/.jsonl file or None for the
    built-in text), samples x tokens, damping, activation order, static groups, device and seed."""

    calibration: str | None = None
    num_samples: int = 128
    seq_len: int = 512
    damp: float = 0.01
    act_order: bool = True
    static_groups: bool = True  # g_idx k // group_size: the kernels' fast paths and tensor-parallel row shards
    device: str = "auto"
    seed: int = 0


def quantize_checkpoint(src: str | Path, out: str | Path, bits: int = 8, group_size: int = 128, sym: bool = True,
                        exclude=(), in_place: bool = False, shard_bytes: int = SHARD_BYTES, method: str = "rtn",
                        gptq: GPTQOptions | None = None, lm_head: bool = False, log=print) -> Path:
    """Quantize the dense checkpoint folder `src` into `out` (or rewrite `src` when in_place)."""
    if method not in METHODS:
        raise ConfigError(f"--method {method!r}: choose gptq (calibrated) or rtn (round-to-nearest)")
    if bits not in (4, 8):
        raise ConfigError(f"--bits {bits} is not supported: qv writes GPTQ-Int8 and GPTQ-Int4 (bits 8 or 4)")
    if group_size != -1 and group_size < 1:
        raise ConfigError(f"--group-size {group_size}: expected -1 (one group over all inputs) or a positive size")
    src, out = Path(src), Path(out)
    if (src.resolve() == out.resolve()) != in_place:
        raise ConfigError("in_place=True rewrites src itself and needs out == src" if in_place else
                          f"out {out} is the source folder; pass in_place=True to rewrite it")
    if not (src / "config.json").is_file():
        raise ConfigError(f"no config.json in {src}")
    config = json.loads((src / "config.json").read_text())
    if "quantization_config" in config:
        raise ConfigError(f"{src} is already quantized (config.json has quantization_config)")
    ModelConfig.from_dict(config)  # a Qwen3.5 checkpoint qv can load, or a clear error now
    if not in_place and out.exists() and (any(out.glob("*.safetensors")) or (out / "config.json").exists()):
        raise ConfigError(f"{out} already holds a checkpoint; choose an empty folder")
    defaults = tuple(p for p in DEFAULT_EXCLUDE if not (lm_head and p == LM_HEAD_EXCLUDE))
    patterns = _compile(defaults + tuple(exclude))
    files = index_checkpoint(src)
    plan, excluded = _plan(files, patterns, group_size, 32 // bits, lm_head)
    head_name = "lm_head.weight" if plan.get("lm_head.weight") else None
    if lm_head and head_name is None:
        raise ConfigError(f"--lm-head: {src} has no separate lm_head.weight to quantize (tied to the embeddings, "
                          "or excluded); QV_LM_HEAD_INT8 quantizes a tied head at load")
    done, desc_act = {}, False
    if method == "gptq":
        done, desc_act = _calibrate(src, config, plan, bits, group_size, sym, gptq or GPTQOptions(), log)
    out.mkdir(parents=True, exist_ok=True)

    dynamic = _dynamic_rules(excluded, config)
    if head_name:  # per-row int8 whatever --bits and --group-size say
        dynamic = {"+:(?:lm_head|language_model\\.lm_head)$": {"bits": 8, "group_size": -1, "sym": True,
                                                                "desc_act": False}, **dynamic}
    qcfg = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "sym": sym, "desc_act": desc_act,
            "checkpoint_format": "gptq", "lm_head": bool(head_name),
            "dynamic": dynamic,
            "modules_to_not_convert": excluded}
    shards = _write_tensors(files, plan, out, group_size, sym, shard_bytes, bits, done)
    if not in_place:
        _copy_others(src, out)
    written = _finish_shards(out, shards)  # renames over same-named old files
    if in_place:  # the dense originals are gone only once every new shard is in place
        for old in sorted(set(files.values())):
            if old.name not in written:
                old.unlink()
        if len(written) == 1:
            (src / "model.safetensors.index.json").unlink(missing_ok=True)
    config["quantization_config"] = qcfg
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def _compile(patterns: tuple[str, ...]) -> list[re.Pattern]:
    compiled = []
    for p in patterns:
        try:
            compiled.append(re.compile(p))
        except re.error as e:
            raise ConfigError(f"--exclude {p!r} is not a valid regex: {e}") from None
    return compiled


def _plan(files: dict[str, Path], patterns: list[re.Pattern], group_size: int, pack: int,
          lm_head: bool = False) -> tuple[dict[str, bool], list[str]]:
    """name -> quantize?; plus the excluded 2-D modules. Checks every quantized shape first, so
    a bad group size fails before anything is written."""
    plan: dict[str, bool] = {}
    excluded, bad = [], []
    shapes: dict[str, list[int]] = {}
    for path in sorted(set(files.values())):
        with safe_open(str(path), framework="pt") as f:
            shapes.update({n: f.get_slice(n).get_shape() for n in f.keys() if files.get(n) == path})
    for name, shape in sorted(shapes.items()):
        module = name[: -len(".weight")]
        if not (name.endswith(".weight") and len(shape) == 2):
            plan[name] = False
            continue
        if any(p.match(module) for p in patterns):
            plan[name] = False
            excluded.append(module)
            continue
        n, k = shape
        if module in ("lm_head", "model.language_model.lm_head") or module.endswith(".lm_head"):
            if k % 4 or n % 4:  # written as int8 with one group: 4 codes a word
                bad.append(f"{module} [{n}, {k}]")
            plan[name] = True
            continue
        if k % pack or n % pack or (group_size != -1 and k % group_size):
            bad.append(f"{module} [{n}, {k}]")
        plan[name] = True
    if bad:
        raise ConfigError(f"cannot quantize with group_size {group_size} (in/out features must be multiples of {pack} "
                          f"and of the group size): {', '.join(bad[:6])}{' ...' if len(bad) > 6 else ''}; "
                          f"choose another --group-size or --exclude these modules")
    return plan, excluded


def _dynamic_rules(excluded: list[str], config: dict) -> dict[str, dict]:
    """One anchored "-:" rule per excluded module, matching its HF and its vLLM name; plus one for
    a vLLM fused layer (in_proj_ba, ...) when all its members are excluded, so vLLM keeps it dense."""
    multimodal = (config.get("architectures") or [""])[0] == "Qwen3_5ForConditionalGeneration"
    rules: dict[str, dict] = {}
    fused_members: dict[str, set[str]] = {}
    for module in excluded:
        vllm, fused = vllm_names(module, multimodal)
        rules["-:(?:" + "|".join(re.escape(n) for n in dict.fromkeys([module, vllm])) + ")$"] = {}
        if fused:
            fused_members.setdefault(fused, set()).add(vllm.rpartition(".")[2])
    for fused, members in fused_members.items():
        if members == set(FUSED[fused.rpartition(".")[2]]):
            rules[f"-:{re.escape(fused)}$"] = {}
    return rules


def rtn_quantize(w: torch.Tensor, group_size: int, sym: bool,
                 bits: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest of a dense weight w [N, K] to `bits` -> codes uint8 [K, N] (one a byte), scales fp16
    [G, N], true zeros int32 [G, N], with w ~= scales * (codes - zeros) per group of `group_size` inputs.
    The ranges follow GPTQ's quantizer: sym uses zero 2^(bits-1) and scale 2*amax/(2^bits - 1)."""
    top = (1 << bits) - 1
    n, k = w.shape
    group = k if group_size == -1 else group_size
    x = w.float().t().reshape(k // group, group, n)  # [G, g, N]
    scale, zero = quant_params(x, bits, sym)
    scale = scale.half()
    codes = torch.clamp(torch.round(x / scale.float()[:, None, :]) + zero[:, None, :], 0, top)
    return codes.reshape(k, n).to(torch.uint8), scale, zero.to(torch.int32)


def pack_gptq(codes: torch.Tensor, zeros: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """codes uint8 [K, N] one a byte, true zeros [G, N] -> (qweight int32 [K/P, N], qzeros int32 [G, N/P])
    in v1, P = 32 / bits."""
    if sys.byteorder != "little":  # the byte views below are GPTQ's shifts only on little-endian hosts
        raise RuntimeError("qv writes GPTQ checkpoints on little-endian hosts only")
    stored = zeros - 1  # checkpoint_format "gptq" (v1)
    if int(stored.min()) < 0 or int(stored.max()) > (1 << bits) - 1:
        raise ValueError(f"GPTQ v1 zeros must lie in 1..{1 << bits}")
    if bits == 4:  # two codes a byte along K (qv's runtime rows) and along N (zeros), then packed as bytes
        codes = pack_nibbles(codes)
        stored = pack_nibbles(stored.to(torch.uint8).t()).t()
    rows, n = codes.shape
    qweight = codes.reshape(rows // 4, 4, n).permute(0, 2, 1).contiguous().view(torch.int32).reshape(rows // 4, n)
    qzeros = stored.to(torch.uint8).contiguous().view(torch.int32)
    return qweight, qzeros


def _write_tensors(files: dict[str, Path], plan: dict[str, bool], out: Path, group_size: int, sym: bool,
                   shard_bytes: int, bits: int,
                   done: dict[str, QuantizedWeight] | None = None) -> list[tuple[Path, list[str]]]:
    """Write temporary shards (renamed by _finish_shards once all exist); returns (path, names). Modules in
    `done` (GPTQ's) are written as they are, the lm_head as row-int8, other planned ones rounded to nearest."""
    done = done or {}
    total = sum(p.stat().st_size for p in set(files.values()))
    shards: list[tuple[Path, list[str]]] = []
    pending: dict[str, torch.Tensor] = {}
    size = 0

    def flush():
        nonlocal pending, size
        if pending:
            path = out / f".qv-tmp-{len(shards):05d}.safetensors"
            save_file(pending, str(path), metadata={"format": "pt"})
            shards.append((path, sorted(pending)))
        pending, size = {}, 0

    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        by_file.setdefault(path, []).append(name)
    bar = tqdm(total=len(files), desc="quantize", unit="tensor", disable=total < (1 << 30))
    for path in sorted(by_file):
        with safe_open(str(path), framework="pt") as f:
            for name in sorted(by_file[path]):
                t = f.get_tensor(name)
                if plan[name]:
                    module = name[: -len(".weight")]
                    if module == "lm_head":  # one bf16-exact scale a row (fp16 holds it exactly), zero 128
                        q = quantize_rows_int8(t, torch.bfloat16)
                        zeros = torch.full_like(q.scales, 128, dtype=torch.int32)
                        qw = QuantizedWeight(q.qweight, q.scales.half(), zeros, q.g_idx)
                        wbits = 8
                    elif module in done:
                        qw, wbits = done[module], bits
                    else:
                        codes, scales, zeros = rtn_quantize(t, group_size, sym, bits)
                        g = codes.shape[0] if group_size == -1 else group_size
                        qw = QuantizedWeight(codes, scales, zeros, torch.arange(codes.shape[0], dtype=torch.int32) // g)
                        wbits = bits
                    qweight, qzeros = pack_gptq(qw.codes, qw.zeros, wbits)
                    new = {f"{module}.qweight": qweight, f"{module}.qzeros": qzeros, f"{module}.scales": qw.scales,
                           f"{module}.g_idx": qw.g_idx}
                else:
                    new = {name: t.contiguous()}
                for key, value in new.items():
                    pending[key] = value
                    size += value.numel() * value.element_size()
                if size >= shard_bytes:
                    flush()
                bar.update(1)
    flush()
    bar.close()
    return shards


def _calibrate(src: Path, config: dict, plan: dict[str, bool], bits: int, group_size: int, sym: bool,
               opts: GPTQOptions, log) -> tuple[dict[str, QuantizedWeight], bool]:
    """GPTQ of the decoder layers' planned modules; returns them and whether g_idx is permuted (desc_act)."""
    from qv.model.gptq import calibration_ids, calibration_texts, gptq_layers, load_calibration_tokenizer

    if not 0 < opts.damp < 1:
        raise ConfigError(f"--damp {opts.damp}: expected a share of the mean Hessian diagonal in (0, 1)")
    cfg = ModelConfig.from_dict(config)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if opts.device == "auto" else opts.device
    layers = f"{cfg.weight_prefix}layers."
    modules = {n[: -len(".weight")] for n, q in plan.items() if q and n.startswith(layers)}
    others = sorted(n[: -len(".weight")] for n, q in plan.items() if q and not n.startswith(layers)
                    and n != "lm_head.weight")
    tokenizer = load_calibration_tokenizer(src)
    ids = calibration_ids(tokenizer, calibration_texts(opts.calibration), opts.num_samples, opts.seq_len, opts.seed)
    log(f"GPTQ on {device}: {len(modules)} modules in {cfg.num_hidden_layers} layers, {ids.shape[0]} calibration "
        f"samples of {ids.shape[1]} tokens ({opts.calibration or 'built-in text'}), damp {opts.damp}, "
        f"act order {'on' if opts.act_order else 'off'}{', static groups' if opts.static_groups else ''}")
    if others:
        log(f"round-to-nearest (no calibration pass outside the decoder layers): {', '.join(others[:4])}"
            f"{' ...' if len(others) > 4 else ''}")
    done, report = gptq_layers(src, cfg, modules, ids, bits, group_size, sym, opts.damp, opts.act_order,
                               opts.static_groups, device)
    log(report.summary())
    return done, opts.act_order and not opts.static_groups and group_size != -1


def _finish_shards(out: Path, shards: list[tuple[Path, list[str]]]) -> set[str]:
    """Give the temporary shards their final names (+ index when several); returns the names."""
    if len(shards) == 1:
        shards[0][0].rename(out / "model.safetensors")
        return {"model.safetensors"}
    weight_map, total = {}, 0
    for i, (path, names) in enumerate(shards):
        final = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        total += path.stat().st_size
        path.rename(out / final)
        weight_map.update({n: final for n in names})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return set(weight_map.values())


def _copy_others(src: Path, out: Path) -> None:
    """Tokenizer, generation/processor configs, chat template, README...: everything but weights."""
    for p in sorted(src.iterdir()):
        if p.name.endswith(".safetensors") or p.name in ("model.safetensors.index.json", "config.json"):
            continue
        if p.is_dir():
            shutil.copytree(p, out / p.name, dirs_exist_ok=True)
        else:
            shutil.copy2(p, out / p.name)
