"""Reading checkpoints: safetensors (single or sharded), dense, GPTQ (8 and 4 bits), AWQ and block-FP8 linears.

`CheckpointReader` hands out tensors by checkpoint name, remembers which were used, and turns a
module prefix into a dense weight or a `GPTQWeight` (repacked to qv's runtime layout) depending
on what the checkpoint stores for it. Whether a module is quantized follows the stored tensors;
the `quantization_config` rules (`dynamic`, `modules_to_not_convert`, `lm_head`) are checked
against them, so a config that contradicts its checkpoint fails loudly instead of loading garbage.

GPTQ layout read here (bits b = 8 or 4, P = 32 / b codes per int32; K = in_features, N = out_features,
G = groups):
  qweight int32 [K/P, N]   bits b*i .. b*i+b-1 of qweight[r, n] are the code of input row P*r+i
  qzeros  int32 [G, N/P]   bits b*i .. of qzeros[g, c] are the zero of output column P*c+i
  scales  float [G, N]     g_idx int [K] (group of each input row; permuted under desc_act)
  w[n, k] = scales[g_idx[k], n] * (q[k, n] - zero[g_idx[k], n]); checkpoint_format "gptq" (v1)
  stores zero - 1, read back as code + 1 without wraparound (0xFF -> 256, 0xF -> 16, as exllama does).
The int32 rows viewed as little-endian bytes are qv's runtime layout as they stand: one code a byte at
8 bits, two at 4 (input 2r in the low nibble of byte row r).

AWQ's GEMM layout (4 bits; packed along N, not K):
  qweight int32 [K, N/8]   nibble i of qweight[k, c] is the code of output column 8c + AWQ_ORDER[i]
  qzeros  int32 [G, N/8]   the same order; true zeros (no minus one)
  scales  float [G, N]     groups sequential (no g_idx); repacked at load into the GPTQ runtime layout.

Block FP8 (quant_method "fp8", Qwen's and DeepSeek's FP8 releases), kept as stored (FP8Weight):
  weight            float8_e4m3fn [N, K]
  weight_scale_inv  float [ceil(N/bn), ceil(K/bk)], (bn, bk) = weight_block_size
  w[n, k] = weight[n, k] * weight_scale_inv[n // bn, k // bk]
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from qv.kernels.linear import FP8Weight, GPTQWeight, pack_nibbles
from qv.model_config import ModelConfig, QuantConfig

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
TEXT_PREFIXES = ("model.language_model.", "model.")  # Qwen3_5ForConditionalGeneration, Qwen3_5ForCausalLM

# Checkpoint modules vLLM fuses into one layer (its `packed_modules_mapping` for Qwen3.5). There every
# member must share a precision; qv runs mixed members as separate linears, but only when the config
# says so, since a dense member nobody excluded means the writer and its config disagree.
FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"),
    "in_proj_ba": ("in_proj_b", "in_proj_a"),
}
_FUSED_OF = {member: (fused, members) for fused, members in FUSED.items() for member in members}
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's GEMM packing: nibble i holds column AWQ_ORDER[i] of 8
AWQ_COLUMN_NIBBLE = tuple(AWQ_ORDER.index(c) for c in range(8))  # its inverse: column c sits in this nibble


class CheckpointError(ValueError):
    """A checkpoint that does not match its config; the message names the tensor or file."""


# ---------------------------------------------------------------------------------------------
# which modules the quantization config excludes
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModuleQuant:
    """The quantization settings that apply to one module (after `dynamic` overrides)."""

    excluded_by: str | None  # the rule that keeps the module dense, or None
    bits: int
    group_size: int
    desc_act: bool


class QuantRules:
    """Evaluates `dynamic` (first matching rule wins, as in vLLM), `modules_to_not_convert` and
    `lm_head` for a module, against its HF checkpoint name and its vLLM-style names."""

    def __init__(self, q: QuantConfig, architecture: str):
        self.q = q
        self.multimodal = architecture == "Qwen3_5ForConditionalGeneration"
        self.dynamic: list[tuple[str, re.Pattern, dict]] = []
        for key, value in q.dynamic.items():
            pattern = key[2:] if key.startswith(("-:", "+:")) else key
            try:
                self.dynamic.append((key, re.compile(pattern), value if isinstance(value, dict) else {}))
            except re.error as e:
                raise CheckpointError(f"quantization_config.dynamic rule '{key}' is not a valid regex: {e}") from None
        if q.group_size == 0 or q.group_size < -1:
            raise CheckpointError(f"quantization_config.group_size={q.group_size}: expected -1 or a positive size")

    def names(self, module: str) -> list[str]:
        """`module` as written in the checkpoint, plus the names vLLM gives it (unfused and fused)."""
        vllm, fused = vllm_names(module, self.multimodal)
        return list(dict.fromkeys([module, vllm] + ([fused] if fused else [])))

    def resolve(self, module: str) -> ModuleQuant:
        q, names = self.q, self.names(module)
        over: dict = {}
        for key, rx, value in self.dynamic:
            if any(rx.match(n) for n in names):
                if key.startswith("-:"):
                    return ModuleQuant(f"dynamic rule '{key}'", q.bits, q.group_size, q.desc_act)
                over = value
                break
        for entry in q.modules_to_not_convert:
            if any(_names_entry(n, entry) for n in names):
                return ModuleQuant(f"modules_to_not_convert entry {entry!r}", q.bits, q.group_size, q.desc_act)
        if module == "lm_head" and not q.lm_head:
            return ModuleQuant("quantization_config.lm_head=false", q.bits, q.group_size, q.desc_act)
        return ModuleQuant(None, int(over.get("bits", q.bits)), int(over.get("group_size", q.group_size)),
                           bool(over.get("desc_act", q.desc_act)))


def vllm_names(module: str, multimodal: bool) -> tuple[str, str | None]:
    """vLLM's name for checkpoint module `module`, and the fused layer's name if vLLM fuses it."""
    name = module
    if module.startswith("model.language_model."):
        name = "language_model.model." + module[len("model.language_model."):]
    elif module.startswith("model.visual."):
        name = "visual." + module[len("model.visual."):]
    elif module == "lm_head" and multimodal:
        name = "language_model.lm_head"
    parent, _, leaf = name.rpartition(".")
    if leaf not in _FUSED_OF:
        return name, None
    return name, f"{parent}.{_FUSED_OF[leaf][0]}" if parent else _FUSED_OF[leaf][0]


def _names_entry(name: str, entry: str) -> bool:
    """True if `entry` names `name` or a module above it: as a dotted part of the name (vLLM's
    substring test, but only at dot boundaries) or as a regex from the start (transformers)."""
    if re.search(rf"(?:^|\.){re.escape(entry)}(?:\.|$)", name):
        return True
    try:
        return re.match(rf"(?:{entry})(?:(?<=\.)|(?=\.|$))", name) is not None
    except re.error:
        return False


# ---------------------------------------------------------------------------------------------
# the reader
# ---------------------------------------------------------------------------------------------


class CheckpointReader:
    def __init__(self, model_dir: str | Path, cfg: ModelConfig):
        self.dir = Path(model_dir)
        self.cfg = cfg
        self.files = index_checkpoint(self.dir)  # tensor name -> file
        self.text_prefix = self._text_prefix()
        self.rules = QuantRules(cfg.quant, cfg.architecture) if cfg.quant is not None else None
        self._handles: dict[Path, object] = {}
        self.used: set[str] = set()

    def _text_prefix(self) -> str:
        """The prefix the checkpoint really uses for text tensors; either is accepted whatever the
        architecture, so a text-only export of a multimodal model (or the reverse) loads."""
        found = [p for p in TEXT_PREFIXES if f"{p}embed_tokens.weight" in self.files]
        if len(found) > 1:
            raise CheckpointError(f"checkpoint {self.dir} has both {found[0]}embed_tokens.weight and "
                                  f"{found[1]}embed_tokens.weight: which text model is meant is ambiguous")
        return found[0] if found else self.cfg.weight_prefix

    def _actual(self, name: str) -> str:
        want = self.cfg.weight_prefix
        if want != self.text_prefix and name.startswith(want):
            return self.text_prefix + name[len(want):]
        return name

    def names(self) -> list[str]:
        return sorted(self.files)

    def nbytes(self) -> int:
        """Bytes of the checkpoint's files: what the progress bar measures."""
        return sum(f.stat().st_size for f in set(self.files.values()))

    def has(self, name: str) -> bool:
        return self._actual(name) in self.files

    def _handle(self, path: Path):
        if path not in self._handles:
            self._handles[path] = safe_open(str(path), framework="pt")
        return self._handles[path]

    def _raw(self, name: str) -> torch.Tensor:
        actual = self._actual(name)
        if actual not in self.files:
            raise CheckpointError(f"checkpoint {self.dir} lacks tensor {actual!r}")
        t = self._handle(self.files[actual]).get_tensor(actual)
        self.used.add(actual)
        return t

    def tensor(self, name: str, dtype: torch.dtype | None = None, device: torch.device | str = "cpu",
               shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """Tensor `name`, checked against `shape`; asking for a float `dtype` requires a stored
        fp32/fp16/bf16 tensor (an integer one here is a wrong or mislabelled checkpoint)."""
        t = self._raw(name)
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"tensor {self._actual(name)!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
        if dtype is not None and dtype.is_floating_point and t.dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"tensor {self._actual(name)!r} has dtype {t.dtype}; expected float32/float16/bfloat16")
        return t.to(device=device, dtype=dtype or t.dtype)

    def _int_tensor(self, name: str, shape: tuple[int, ...], dtypes=(torch.int32,)) -> torch.Tensor:
        t = self._raw(name)
        if t.dtype not in dtypes:
            raise CheckpointError(f"tensor {self._actual(name)!r} has dtype {t.dtype}; expected "
                                  f"{'/'.join(str(d).removeprefix('torch.') for d in dtypes)}")
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"tensor {self._actual(name)!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
        return t

    def linear(self, prefix: str, out_features: int, in_features: int, dtype: torch.dtype,
               device: torch.device | str = "cpu") -> torch.Tensor | GPTQWeight | FP8Weight:
        """The weight of module `prefix`: dense [N, K] in `dtype`, or GPTQWeight / FP8Weight if stored quantized."""
        module = self._actual(prefix)
        has_q, has_w = self.has(f"{prefix}.qweight"), self.has(f"{prefix}.weight")
        if has_q and has_w:
            raise CheckpointError(f"{module} is stored both dense (.weight) and GPTQ-quantized (.qweight)")
        if self.has(f"{prefix}.weight_scale_inv"):
            return self._fp8(prefix, out_features, in_features, device)
        if has_q:
            return self._gptq(prefix, out_features, in_features, dtype, device)
        if not has_w:
            raise CheckpointError(f"checkpoint {self.dir} has neither {module}.weight nor {module}.qweight")
        self._check_dense_member(prefix)
        return self.tensor(f"{prefix}.weight", dtype, device, shape=(out_features, in_features))

    def _check_dense_member(self, prefix: str) -> None:
        parent, _, leaf = prefix.rpartition(".")
        if self.rules is None or leaf not in _FUSED_OF:
            return
        quantized = [m for m in _FUSED_OF[leaf][1] if m != leaf and (self.has(f"{parent}.{m}.qweight")
                                                                    or self.has(f"{parent}.{m}.weight_scale_inv"))]
        if quantized and self.rules.resolve(self._actual(prefix)).excluded_by is None:
            raise CheckpointError(
                f"{self._actual(prefix)} is stored dense but nothing in quantization_config excludes it, while "
                f"its fused sibling(s) {', '.join(quantized)} are quantized; add a '-:' dynamic rule or a "
                f"modules_to_not_convert entry for it if the checkpoint is meant to be mixed")

    def _fp8(self, prefix: str, n: int, k: int, device) -> FP8Weight:
        module = self._actual(prefix)
        q = self.cfg.quant
        if q is None or q.method != "fp8":
            raise CheckpointError(f"{module}.weight_scale_inv is stored but config.json's quantization_config is not "
                                  "quant_method fp8 with a weight_block_size")
        if prefix == "lm_head":
            raise CheckpointError("lm_head is stored in FP8: an FP8 vocabulary projection is not built (Qwen's FP8 "
                                  "releases keep it dense, which the sampler, MTP's top-1 and Clef's head read)")
        mq = self.rules.resolve(module)
        if mq.excluded_by is not None:
            raise CheckpointError(f"{module} is stored in FP8 but {mq.excluded_by} excludes it from quantization")
        if self.has(f"{prefix}.input_scale"):
            raise CheckpointError(f"{module}.input_scale: static FP8 activation scales are not built (qv scales "
                                  "activations at run time)")
        weight = self._raw(f"{prefix}.weight")
        if weight.dtype != torch.float8_e4m3fn:
            raise CheckpointError(f"tensor {module}.weight beside weight_scale_inv has dtype {weight.dtype}; expected "
                                  "float8_e4m3fn")
        if tuple(weight.shape) != (n, k):
            raise CheckpointError(f"tensor {module}.weight has shape {tuple(weight.shape)}, expected {(n, k)}")
        bn, bk = q.weight_block_size
        scale = self.tensor(f"{prefix}.weight_scale_inv", torch.float32, shape=(-(-n // bn), -(-k // bk)))
        return FP8Weight(weight.to(device), scale.to(device), (bn, bk))

    def _gptq(self, prefix: str, n: int, k: int, dtype: torch.dtype, device) -> GPTQWeight:
        module = self._actual(prefix)
        if self.rules is None:
            raise CheckpointError(f"{module}.qweight is stored but config.json has no quantization_config")
        if self.cfg.quant.method == "fp8":
            raise CheckpointError(f"{module}.qweight is stored but quantization_config says quant_method fp8")
        mq = self.rules.resolve(module)
        if mq.excluded_by is not None:
            raise CheckpointError(f"{module} is stored GPTQ-quantized but {mq.excluded_by} excludes it from quantization")
        if mq.bits not in (4, 8):
            raise CheckpointError(f"{module}: bits={mq.bits} (from quantization_config); qv loads 8- and 4-bit GPTQ")
        awq = self.cfg.quant.method == "awq"
        bits, pack = mq.bits, 32 // mq.bits
        group = k if mq.group_size == -1 else mq.group_size
        name = "AWQ" if awq else f"GPTQ-Int{bits}"
        if k % pack or n % pack:
            raise CheckpointError(f"{module}: {name} packs {pack} codes per int32; in/out features {k}/{n} must be "
                                  f"multiples of {pack}")
        if group <= 0 or k % group:
            raise CheckpointError(f"{module}: group_size {mq.group_size} does not divide in_features {k}")
        n_groups = k // group
        scales = self.tensor(f"{prefix}.scales", dtype, shape=(n_groups, n))
        if awq:
            codes = pack_nibbles(_awq_unpack(self._int_tensor(f"{prefix}.qweight", (k, n // 8))))
            z = _awq_unpack(self._int_tensor(f"{prefix}.qzeros", (n_groups, n // 8))).to(torch.int32)
        else:
            qweight = self._int_tensor(f"{prefix}.qweight", (k // pack, n))
            codes = _unpack_rows(qweight, k * bits // 8, n)
            z = None
            if self.has(f"{prefix}.qzeros"):
                z = _unpack_columns(self._int_tensor(f"{prefix}.qzeros", (n_groups, n // pack)), bits)
                if self.cfg.quant.checkpoint_format == "gptq":
                    z = z + 1  # v1 stores zero - 1; in int32, so a stored all-ones code reads 2^bits like exllama
            elif not self.cfg.quant.sym:
                raise CheckpointError(f"{module}: asymmetric GPTQ (sym=false) needs {module}.qzeros")
        zeros = None
        if z is not None and not bool((z == 1 << (bits - 1)).all()):  # the middle code everywhere: symmetric
            zeros = z.to(dtype)
        if self.has(f"{prefix}.g_idx") and not awq:
            g_idx = self._int_tensor(f"{prefix}.g_idx", (k,), INT_DTYPES).to(torch.int32)
            if int(g_idx.min()) < 0 or int(g_idx.max()) >= n_groups:
                raise CheckpointError(f"{module}.g_idx has groups {int(g_idx.min())}..{int(g_idx.max())}, "
                                      f"expected 0..{n_groups - 1}")
        elif mq.desc_act and n_groups > 1:
            raise CheckpointError(f"{module}: desc_act=true needs {module}.g_idx (the group of each input row)")
        else:
            g_idx = torch.arange(k, dtype=torch.int32) // group
        if self.has(f"{prefix}.bias"):
            # GPTQ writers emit a zero bias for bias-less layers (vLLM skips it); qv drops it, so a
            # non-zero one would silently change the output.
            bias = self.tensor(f"{prefix}.bias", torch.float32)
            if bool(bias.any()):
                raise CheckpointError(f"{module}.bias is non-zero beside a {name} weight; qv only skips zero "
                                      "placeholders")
        return GPTQWeight(codes.to(device), scales.to(device), None if zeros is None else zeros.to(device),
                          g_idx.to(device), group, bits)

    def unused(self, ignore_prefixes: tuple[str, ...] = ()) -> list[str]:
        return [n for n in self.names() if n not in self.used and not n.startswith(ignore_prefixes)]


def _unpack_rows(qweight: torch.Tensor, rows: int, n: int) -> torch.Tensor:
    """int32 [rows/4, N] -> uint8 [rows, N] (little-endian bytes are byte rows 4r..4r+3): the codes at 8 bits,
    at 4 bits the packed rows of the runtime layout (byte j of an int32 holds its nibbles 2j and 2j + 1)."""
    if sys.byteorder != "little":  # the byte view below assumes it; GPTQ's shifts are little-endian
        raise RuntimeError("qv reads GPTQ checkpoints on little-endian hosts only")
    return qweight.contiguous().view(torch.uint8).view(rows // 4, n, 4).permute(0, 2, 1).reshape(rows, n)


def _unpack_columns(qzeros: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [G, N/P] -> int32 zeros [G, N], P = 32 / bits codes per word, the lowest bits first."""
    g, words = qzeros.shape
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    return ((qzeros.to(torch.int32)[:, :, None] >> shifts) & ((1 << bits) - 1)).reshape(g, words * (32 // bits))


def _awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """AWQ int32 [R, N/8] -> uint8 codes [R, N], undoing AWQ_ORDER within each word."""
    r, words = packed.shape
    nibbles = _unpack_columns(packed, 4).view(r, words, 8)
    return nibbles[:, :, list(AWQ_COLUMN_NIBBLE)].reshape(r, 8 * words).to(torch.uint8)


# ---------------------------------------------------------------------------------------------
# files
# ---------------------------------------------------------------------------------------------


def _keys(path: Path) -> list[str]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    except Exception as e:  # safetensors raises its own error types for truncated/corrupt headers
        raise CheckpointError(f"cannot read safetensors file {path}: {e}") from None


NOT_BACKBONE_FILES = ("joint_head.safetensors",)


def index_checkpoint(model_dir: str | Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from `model.safetensors.index.json` when present (every
    listed shard must exist and hold the tensors the index gives it), else every *.safetensors."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (json.JSONDecodeError, AttributeError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no weight_map")
        missing = sorted({v for v in weight_map.values() if not (model_dir / v).is_file()})
        if missing:
            raise CheckpointError(f"missing shard(s) listed in {index.name}: {', '.join(missing)}")
        for shard in sorted(set(weight_map.values())):
            held = set(_keys(model_dir / shard))
            absent = sorted(n for n, f in weight_map.items() if f == shard and n not in held)
            if absent:
                raise CheckpointError(f"{index.name} maps {absent[0]!r}"
                                      f"{f' (+{len(absent) - 1} more)' if len(absent) > 1 else ''} to shard "
                                      f"{shard}, which does not contain it")
        return {name: model_dir / fname for name, fname in weight_map.items()}
    # A Clef release keeps its joint schema head beside the backbone; it is not backbone weights.
    files = sorted(p for p in model_dir.glob("*.safetensors") if p.name not in NOT_BACKBONE_FILES)
    if not files:
        bins = sorted(p.name for p in model_dir.glob("*.bin"))
        hint = f" (found {', '.join(bins[:3])}: qv reads safetensors only)" if bins else ""
        raise CheckpointError(f"no *.safetensors files in {model_dir}{hint}")
    out: dict[str, Path] = {}
    for path in files:
        for name in _keys(path):
            if name in out:
                raise CheckpointError(f"tensor {name!r} is stored in both {out[name].name} and {path.name}")
            out[name] = path
    return out
