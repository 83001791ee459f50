"""GPTQ-Int4 and AWQ checkpoints against transformers on their dequantized weights.

The checkpoints are written by this file in the standard layouts, packed with plain numpy shifts (not
qv's code): GPTQ int32 qweight [K/8, N] (nibble i of row r is input 8r+i), qzeros [G, N/8]; AWQ's GEMM
layout int32 qweight [K, N/8] packed along N in AWQ's order 0,2,4,6,1,3,5,7, qzeros alike. The dense twin
for transformers is dequantized by this file from the stored tensors, so a wrong nibble order, zero
offset, group lookup or dynamic rule in qv's loader moves the logits far beyond the bound.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from qv.config import ModelConfig
from qv.model.weights import CheckpointError, CheckpointReader
from hf_oracle import assert_matches_hf
from test_quantize import read_all

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def pack_rows4(codes: np.ndarray) -> torch.Tensor:
    """GPTQ: codes [K, N] in 0..15 -> int32 [K/8, N], nibble i of row r = input 8r + i."""
    k, n = codes.shape
    out = np.zeros((k // 8, n), dtype=np.uint32)
    for i in range(8):
        out |= codes[i::8].astype(np.uint32) << (4 * i)
    return torch.from_numpy(out.view(np.int32))


def pack_columns4(values: np.ndarray, order=range(8)) -> torch.Tensor:
    """[R, N] in 0..15 -> int32 [R, N/8], nibble i of word c = column 8c + order[i]."""
    r, n = values.shape
    out = np.zeros((r, n // 8), dtype=np.uint32)
    for i, col in enumerate(order):
        out |= values[:, col::8].astype(np.uint32) << (4 * i)
    return torch.from_numpy(out.view(np.int32))


def unpack_columns4(packed: torch.Tensor, order=range(8)) -> np.ndarray:
    u = packed.numpy().view(np.uint32)
    out = np.zeros((u.shape[0], u.shape[1] * 8), dtype=np.int64)
    for i, col in enumerate(order):
        out[:, col::8] = (u >> (4 * i)) & 15
    return out


def unpack_rows4(packed: torch.Tensor) -> np.ndarray:
    u = packed.numpy().view(np.uint32)
    out = np.zeros((u.shape[0] * 8, u.shape[1]), dtype=np.int64)
    for i in range(8):
        out[i::8] = (u >> (4 * i)) & 15
    return out


def rtn4(w: torch.Tensor, g_idx: np.ndarray, groups: int, sym: bool, zero_low: bool = False):
    """Codes [K, N], scales fp16 [G, N], true zeros [G, N] (numpy, float64 loops over the groups)."""
    x = w.double().t().numpy()
    k, n = x.shape
    scales, zeros = np.zeros((groups, n)), np.zeros((groups, n), dtype=np.int64)
    for g in range(groups):
        rows = x[g_idx == g]
        hi, lo = np.maximum(rows.max(0), 0), np.minimum(rows.min(0), 0)
        if sym:
            scales[g], zeros[g] = np.maximum(hi, -lo) * 2 / 15 + 1e-12, 8
        else:
            scales[g] = (hi - lo) / 15 + 1e-12
            zeros[g] = np.clip(np.round(-lo / scales[g]), 0, 15)
    if zero_low:  # true zero 0: v1 stores it as nibble 0xF, which exllama (and qv) read back as 16
        zeros[0, :8] = 0
    scales = scales.astype(np.float16)
    codes = np.clip(np.round(x / scales[g_idx].astype(np.float64)) + zeros[g_idx], 0, 15).astype(np.int64)
    return codes, torch.from_numpy(scales), zeros


def write_checkpoint(src: Path, out: Path, tensors: dict, qcfg: dict) -> Path:
    out.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = qcfg
    (out / "config.json").write_text(json.dumps(config))
    for extra in src.iterdir():  # tokenizer files etc.
        if extra.suffix != ".safetensors" and extra.name != "config.json" and extra.is_file():
            (out / extra.name).write_bytes(extra.read_bytes())
    return out


def module_settings(module: str, qcfg: dict) -> dict | None:
    """Settings of `module` under `qcfg`'s dynamic rules (first match wins), None when a "-:" rule excludes it."""
    for key, value in qcfg.get("dynamic", {}).items():
        if re.match(key[2:] if key.startswith(("-:", "+:")) else key, module):
            return None if key.startswith("-:") else dict(qcfg, **value)
    return qcfg


def write_gptq4(src: Path, out: Path, quantize: str, qcfg: dict, seed: int) -> Path:
    """GPTQ checkpoint of `src`: modules matching `quantize` stored at their dynamic bits (4 or 8)."""
    rng = np.random.default_rng(seed)
    fmt, sym = qcfg["checkpoint_format"], qcfg["sym"]
    tensors = {}
    for name, w in read_all(src).items():
        module = name.removesuffix(".weight")
        mq = module_settings(module, qcfg) if name.endswith(".weight") and w.dim() == 2 else None
        if mq is None or not re.search(quantize, module):
            tensors[name] = w
            continue
        n, k = w.shape
        group = k if mq["group_size"] == -1 else mq["group_size"]
        g_idx = np.arange(k) // group
        if mq["desc_act"]:
            g_idx = g_idx[rng.permutation(k)]
        if mq["bits"] == 8:  # a dynamic rule keeps this one at 8 bits: bytes, as GPTQ-Int8 stores them
            from test_quantize import pack, rtn
            codes, s, z = rtn(w, torch.from_numpy(g_idx), k // group, sym, torch.float16)
            tensors[f"{module}.qweight"] = pack(codes, 0)
            tensors[f"{module}.qzeros"] = pack((z - 1) & 0xFF if fmt == "gptq" else z, 1)
        else:
            codes, s, z = rtn4(w, g_idx, k // group, sym, zero_low=fmt == "gptq" and not sym)
            tensors[f"{module}.qweight"] = pack_rows4(codes)
            if not (sym and fmt == "gptq_v2" and seed % 2):  # v2 sym may omit qzeros
                tensors[f"{module}.qzeros"] = pack_columns4((z - 1) & 15 if fmt == "gptq" else z)
        tensors[f"{module}.scales"] = s
        tensors[f"{module}.g_idx"] = torch.from_numpy(g_idx.astype(np.int32))
    return write_checkpoint(src, out, tensors, qcfg)


def write_awq(src: Path, out: Path, not_convert: list[str], group: int) -> Path:
    tensors = {}
    for name, w in read_all(src).items():
        module = name.removesuffix(".weight")
        skip = (not name.endswith(".weight") or w.dim() != 2 or "embed" in module or module.endswith("lm_head")
                or any(re.search(rf"(^|\.){re.escape(e)}(\.|$)", module) for e in not_convert))
        if skip:
            tensors[name] = w
            continue
        n, k = w.shape
        g_idx = np.arange(k) // group
        codes, s, z = rtn4(w, g_idx, k // group, sym=False)
        tensors[f"{module}.qweight"] = pack_columns4(codes, AWQ_ORDER)
        tensors[f"{module}.qzeros"] = pack_columns4(z, AWQ_ORDER)
        tensors[f"{module}.scales"] = s
    qcfg = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": not_convert}
    return write_checkpoint(src, out, tensors, qcfg)


def dequantize4(t: dict, module: str, q: dict) -> torch.Tensor:
    """float64 [N, K] from the stored tensors, by this file's unpacking."""
    s = t[f"{module}.scales"].double().numpy()
    if q["quant_method"] == "awq":
        codes = unpack_columns4(t[f"{module}.qweight"], AWQ_ORDER)
        z = unpack_columns4(t[f"{module}.qzeros"], AWQ_ORDER)
        g = np.arange(codes.shape[0]) // (codes.shape[0] // s.shape[0])
    else:
        g = t[f"{module}.g_idx"].long().numpy()
        if t[f"{module}.qweight"].shape[0] * 4 == g.shape[0]:  # an 8-bit module under a dynamic rule
            from test_quantize import dequantize
            return dequantize(t, module, q["checkpoint_format"])
        codes = unpack_rows4(t[f"{module}.qweight"])
        one = 1 if q["checkpoint_format"] == "gptq" else 0
        z = unpack_columns4(t[f"{module}.qzeros"]) + one if f"{module}.qzeros" in t else np.full(s.shape, 8)
    return torch.from_numpy((codes - z[g]) * s[g]).t()


def dense_twin4(folder: Path, out: Path) -> Path:
    config = json.loads((folder / "config.json").read_text())
    q = config.pop("quantization_config")
    t = read_all(folder)
    dense = {}
    for name, v in t.items():
        if name.endswith(".qweight"):
            module = name.removesuffix(".qweight")
            dense[f"{module}.weight"] = dequantize4(t, module, q).float().contiguous()
        elif not name.endswith((".qzeros", ".scales", ".g_idx")):
            dense[name] = v
    out.mkdir()
    save_file(dense, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config))
    return out


def compare(folder: Path, tmp_path: Path, label: str, seed: int) -> float:
    """qv on the quantized folder vs transformers float64 on its dense twin (tests/hf_oracle.py)."""
    vocab = json.loads((folder / "config.json").read_text())
    vocab = vocab.get("text_config", vocab)["vocab_size"]
    t = 20 + seed % 30
    ids = torch.randint(0, vocab, (t,), generator=torch.Generator().manual_seed(seed))
    twin = dense_twin4(folder, tmp_path / f"{folder.name}-dense")
    err, noise = assert_matches_hf(folder, twin, ids, f"{label} (seed {seed}, {t} tokens)")
    print(f"{label}: rel err {err:.2e}" + ("" if noise is None else f" (fp32 noise {noise:.2e})"))
    return err


QUANTIZE = r"(mlp|in_proj_qkv|in_proj_z|out_proj|self_attn)\.\w+$"
# gqa1: K = 64 (attention, in_proj_*), 128 (down_proj), 32 (out_proj): groups 32, 64 and 128 all occur
DYNAMIC = {r"+:.*down_proj$": {"group_size": 128}, r"+:.*o_proj$": {"group_size": 64},
           r"+:.*mlp\.up_proj$": {"bits": 8}, r"-:.*k_proj$": {}}


@pytest.mark.parametrize("fmt,sym,desc_act,seed", [
    ("gptq", False, True, 1),  # v1 asym act-order, with true zeros of 0 (stored 0xF)
    ("gptq", True, False, 2),
    ("gptq_v2", False, False, 3),
    ("gptq_v2", True, True, 5),  # v2 sym without qzeros
], ids=["v1-asym-actorder", "v1-sym", "v2-asym", "v2-sym-actorder-noqzeros"])
def test_gptq_int4_matches_transformers(tiny_dirs, tmp_path, fmt, sym, desc_act, seed):
    qcfg = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": sym, "desc_act": desc_act,
            "checkpoint_format": fmt, "dynamic": DYNAMIC}
    out = write_gptq4(tiny_dirs("gqa1"), tmp_path / "g4", QUANTIZE, qcfg, seed)
    t = read_all(out)
    assert "model.layers.0.self_attn.k_proj.weight" in t and "model.layers.0.mlp.down_proj.qweight" in t
    assert t["model.layers.0.mlp.up_proj.qweight"].shape[0] == 64 // 4  # 8-bit beside 4-bit modules
    cfg = ModelConfig.from_dir(out)
    w = CheckpointReader(out, cfg).linear("model.layers.0.mlp.down_proj", 64, 128, torch.float32)
    assert (w.bits, w.group_size, tuple(w.qweight.shape)) == (4, 128, (64, 64))
    assert (w.zeros is None) == sym
    compare(out, tmp_path, f"GPTQ-Int4 {fmt} sym={sym} desc_act={desc_act}", seed)


@pytest.mark.parametrize("preset,group", [("gqa1", 32), ("tiny", 32), ("mixed", 16)])
def test_awq_matches_transformers(tiny_dirs, tmp_path, preset, group):
    out = write_awq(tiny_dirs(preset), tmp_path / "awq", ["in_proj_a", "in_proj_b", "k_proj", "visual"], group)
    t = read_all(out)
    assert any(n.endswith("k_proj.weight") for n in t) and any(n.endswith("k_proj.qweight") for n in t) is False
    assert any(n.endswith("in_proj_qkv.qweight") for n in t)
    compare(out, tmp_path, f"AWQ {preset} group {group}", group)


def test_awq_module_not_excluded_but_dense_sibling_fails(tiny_dirs, tmp_path):
    src = tiny_dirs("gqa1")
    out = write_awq(src, tmp_path / "awq", ["in_proj_a", "in_proj_b", "k_proj"], 32)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["modules_to_not_convert"] = ["in_proj_a", "in_proj_b"]
    (out / "config.json").write_text(json.dumps(cfg))
    from qv.model.qwen3_5 import load_text_model

    with pytest.raises(CheckpointError, match="k_proj"):
        load_text_model(str(out))


def test_runtime_layout_is_gptq_bytes(tiny_dirs, tmp_path):
    """The loaded 4-bit qweight is the checkpoint's int32 rows as bytes: byte row r = inputs 2r (low), 2r+1."""
    qcfg = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False,
            "checkpoint_format": "gptq_v2"}
    out = write_gptq4(tiny_dirs("gqa1"), tmp_path / "g4", r"mlp\.gate_proj$", qcfg, 0)
    t = read_all(out)
    codes = unpack_rows4(t["model.layers.0.mlp.gate_proj.qweight"])  # [K, N]
    w = CheckpointReader(out, ModelConfig.from_dir(out)).linear("model.layers.0.mlp.gate_proj", 128, 64, torch.float32)
    packed = w.qweight.numpy().astype(np.int64)
    assert np.array_equal(packed & 15, codes[0::2]) and np.array_equal(packed >> 4, codes[1::2])
    assert np.array_equal(w.codes().numpy(), codes)
    raw = t["model.layers.0.mlp.gate_proj.qweight"].numpy().view(np.uint8).reshape(8, 128, 4)
    assert np.array_equal(raw.transpose(0, 2, 1).reshape(32, 128), w.qweight.numpy())


# ---- qv quantize --bits 4 ------------------------------------------------------------------------


@pytest.mark.parametrize("preset,flags", [("tiny", ["--group-size", "32"]),
                                          ("gqa1", ["--group-size", "-1", "--asym"])], ids=["tiny-g32", "gqa1-asym"])
def test_qv_quantize_4bit_matches_transformers(tiny_dirs, tmp_path, preset, flags):
    from qv.cli import main as qv_main

    src = tiny_dirs(preset)
    out = tmp_path / "g4"
    assert qv_main(["quantize", str(src), str(out), "--method", "rtn", "--bits", "4", *flags]) == 0
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (q["quant_method"], q["bits"], q["checkpoint_format"], q["sym"]) == ("gptq", 4, "gptq", "--asym" not in flags)
    t, orig = read_all(out), read_all(src)
    quantized = [n.removesuffix(".qweight") for n in t if n.endswith(".qweight")]
    assert quantized
    for module in quantized:  # round-to-nearest: each weight within ~half a step of its dequantized value
        w = orig[f"{module}.weight"].double()
        n, k = w.shape
        assert t[f"{module}.qweight"].shape == (k // 8, n) and t[f"{module}.qzeros"].shape[1] == n // 8
        s = t[f"{module}.scales"].double()[t[f"{module}.g_idx"].long()].t()
        assert ((dequantize4(t, module, q) - w).abs() <= 0.6 * s).all(), module
    compare(out, tmp_path, f"qv quantize --bits 4 {preset} {' '.join(flags)}", 7)


def weight_rms_error(dense: dict, quant: dict, q: dict) -> float:
    """RMS of (dequantized - dense) over RMS of dense, every quantized linear together."""
    num = den = 0.0
    for name in quant:
        if name.endswith(".qweight"):
            module = name.removesuffix(".qweight")
            w = dense[f"{module}.weight"].double()
            deq = dequantize4(quant, module, q) if q["bits"] == 4 else __import__("test_quantize").dequantize(
                quant, module, q["checkpoint_format"])
            num += float(((deq - w) ** 2).sum())
            den += float((w ** 2).sum())
    return (num / den) ** 0.5


def test_logit_error_against_bf16_for_8_and_4_bits(tiny_dirs, tmp_path):
    """The published comparison (docs/VALIDATION.md): the tiny gqa1 model with bf16 weights, `qv quantize`
    RTN group 32 at 8 and 4 bits, qv's fp32 logits of a fixed 48-token prompt against the bf16 model's.
    Deterministic (seeded weights and prompt); the bounds hold the measured values with 1.5x room or more,
    and a broken packing or zero gives errors near 1."""
    from hf_oracle import qv_logits
    from qv.model.quantize import quantize_checkpoint
    from util import rel_err

    src = tiny_dirs("gqa1")
    bf16 = tmp_path / "bf16"
    bf16.mkdir()
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            (bf16 / f.name).write_bytes(f.read_bytes())
    dense = {k: v.to(torch.bfloat16) for k, v in read_all(src).items()}
    save_file(dense, str(bf16 / "model.safetensors"))
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    ids = torch.randint(0, vocab, (48,), generator=torch.Generator().manual_seed(0))
    ref = qv_logits(bf16, ids)
    err, werr = {}, {}
    for bits in (8, 4):
        out = quantize_checkpoint(bf16, tmp_path / f"q{bits}", bits=bits, group_size=32)
        err[bits] = rel_err(qv_logits(out, ids), ref)
        werr[bits] = weight_rms_error(dense, read_all(out), json.loads((out / "config.json").read_text())
                                      ["quantization_config"])
    print(f"logit rel err vs bf16: 8-bit {err[8]:.2e}, 4-bit {err[4]:.2e}; "
          f"weight rel RMS err: 8-bit {werr[8]:.2e}, 4-bit {werr[4]:.2e}")
    assert err[8] < 4e-2 and err[4] < 0.6 and err[4] > 5 * err[8]
    assert werr[8] < 1e-2 and werr[4] < 0.15 and werr[4] > 10 * werr[8]
