"""GPTQ-Int8 checkpoints against transformers on their dequantized weights.

Two writers: `qv quantize` (qv/model/quantize.py), and an independent packer below (its own RTN,
bit-shift packing, gptq_v2, desc_act permuted g_idx, v1 0xFF zero bytes, sharding, placeholder
biases). For each checkpoint the test dequantizes the stored tensors with its own bit-shift code
(not qv's), writes a dense folder, and compares qv (fp32, reading the GPTQ folder) with
transformers (float64, reading the dense folder). A wrong byte order, group lookup, zero offset
or scale orientation in qv's loader changes the logits far beyond the bound.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hf_oracle import assert_matches_hf
from qv.cli import main as qv_main
from qv.config import ConfigError
from qv.model.qwen3_5 import load_text_model


# ---- the test's own GPTQ code (independent of qv) ---------------------------------------------


def pack(codes: torch.Tensor, axis: int) -> torch.Tensor:
    """Pack 4 bytes per int32 along `axis` (0: qweight rows, 1: qzeros columns), byte i << 8i."""
    c = codes.numpy().astype(np.uint32)
    c = c.reshape(c.shape[0] // 4, 4, c.shape[1]) if axis == 0 else c.reshape(c.shape[0], c.shape[1] // 4, 4)
    parts = [c[:, i] if axis == 0 else c[:, :, i] for i in range(4)]
    packed = parts[0] | (parts[1] << 8) | (parts[2] << 16) | (parts[3] << 24)
    return torch.from_numpy(np.ascontiguousarray(packed).view(np.int32))


def unpack(packed: torch.Tensor, axis: int) -> torch.Tensor:
    u = packed.numpy().view(np.uint32)
    parts = np.stack([(u >> (8 * i)) & 0xFF for i in range(4)], axis=axis + 1)
    shape = (u.shape[0] * 4, u.shape[1]) if axis == 0 else (u.shape[0], u.shape[1] * 4)
    return torch.from_numpy(parts.reshape(shape).astype(np.int64))


def dequantize(t: dict[str, torch.Tensor], module: str, fmt: str) -> torch.Tensor:
    """float64 [N, K]; v1 zeros are byte + 1 with no wraparound (0xFF -> 256), as exllama reads them."""
    q = unpack(t[f"{module}.qweight"], 0)
    s = t[f"{module}.scales"].double()
    z = unpack(t[f"{module}.qzeros"], 1) + (1 if fmt == "gptq" else 0) if f"{module}.qzeros" in t else 128
    g = t[f"{module}.g_idx"].long()
    z = z[g] if torch.is_tensor(z) else z
    return ((q - z) * s[g]).t()


def rtn(w: torch.Tensor, g_idx: torch.Tensor, groups: int, sym: bool, scale_dtype) -> tuple:
    """Codes [K, N], scales [G, N], true zeros [G, N]; sym uses amax/127 (qv uses 2*amax/255)."""
    x = w.double().t()
    idx = g_idx.long()[:, None].expand_as(x)
    hi = torch.zeros(groups, x.shape[1], dtype=x.dtype).scatter_reduce(0, idx, x, "amax", include_self=True)
    lo = torch.zeros(groups, x.shape[1], dtype=x.dtype).scatter_reduce(0, idx, x, "amin", include_self=True)
    if sym:
        s, z = torch.maximum(hi, -lo) / 127, torch.full_like(hi, 128)
    else:
        s = (hi - lo) / 255
        z = torch.round(-lo / s).clamp(0, 255)
    s = s.to(scale_dtype)
    codes = torch.clamp(torch.round(x / s.double()[g_idx.long()]) + z[g_idx.long()], 0, 255)
    return codes.long(), s, z.long()


def read_all(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def write_independent(src: Path, out: Path, *, quantize: str, fmt: str, sym: bool, group: int, desc_act: bool,
                      scale_dtype, qcfg_extra: dict, shards: int, seed: int, ff_zeros: bool = False) -> Path:
    """GPTQ checkpoint of `src` with every module matching `quantize` (re.search) packed by this file."""
    gen = torch.Generator().manual_seed(seed)
    out.mkdir()
    dense = read_all(src)
    tensors: dict[str, torch.Tensor] = {}
    for name, w in dense.items():
        module = name.removesuffix(".weight")
        if not (name.endswith(".weight") and w.dim() == 2 and re.search(quantize, module)):
            tensors[name] = w
            continue
        n, k = w.shape
        g = k if group == -1 else group
        g_idx = torch.arange(k) // g
        if desc_act:  # act-order: rows visited in a random order, grouped in visiting order
            g_idx[torch.randperm(k, generator=gen)] = torch.arange(k) // g
        codes, s, z = rtn(w, g_idx, k // g, sym, scale_dtype)
        if ff_zeros:  # v1 cannot store zero 0: AutoGPTQ writes byte 0xFF, exllama reads 256 back
            z[0, :8] = 0
        tensors[f"{module}.qweight"] = pack(codes, 0)
        tensors[f"{module}.scales"] = s
        tensors[f"{module}.g_idx"] = g_idx.to(torch.int32)
        if not sym or fmt == "gptq" or seed % 2:  # v2 sym may omit qzeros
            tensors[f"{module}.qzeros"] = pack((z - 1) & 0xFF if fmt == "gptq" else z, 1)
        tensors[f"{module}.bias"] = torch.zeros(n, dtype=torch.float16)  # GPTQ writers' placeholder
    names = sorted(tensors)
    chunks = [names[i::shards] for i in range(shards)]
    weight_map = {}
    for i, chunk in enumerate(chunks):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: tensors[k].contiguous() for k in chunk}, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in chunk})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 8, "group_size": group, "sym": sym,
                                     "desc_act": desc_act, "checkpoint_format": fmt, **qcfg_extra}
    (out / "config.json").write_text(json.dumps(config))
    return out


def dense_twin(folder: Path, out: Path) -> Path:
    """The dense checkpoint of what `folder` stores, dequantized by this file, for transformers."""
    config = json.loads((folder / "config.json").read_text())
    q = config.pop("quantization_config")
    t = read_all(folder)
    dense = {}
    for name, v in t.items():
        if name.endswith(".qweight"):
            module = name.removesuffix(".qweight")
            dense[f"{module}.weight"] = dequantize(t, module, q.get("checkpoint_format", "gptq")).float().contiguous()
        elif not name.endswith((".qzeros", ".scales", ".g_idx")) and not (
                name.endswith(".bias") and name.removesuffix(".bias") + ".qweight" in t):
            dense[name] = v
    out.mkdir()
    save_file(dense, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config))
    return out


# ---- running both models ----------------------------------------------------------------------


def compare(gptq: Path, tmp_path: Path, label: str) -> float:
    """qv on the GPTQ folder vs transformers float64 on its dense twin (tests/hf_oracle.py)."""
    seed = random.randrange(2**31)
    vocab = json.loads((gptq / "config.json").read_text())
    vocab = vocab.get("text_config", vocab)["vocab_size"]
    t = 20 + seed % 30
    ids = torch.randint(0, vocab, (t,), generator=torch.Generator().manual_seed(seed))
    twin = dense_twin(gptq, tmp_path / f"{gptq.name}-dense")
    err, noise = assert_matches_hf(gptq, twin, ids, f"{label} (seed {seed}, {t} tokens)")
    print(f"{label}: rel err {err:.2e}" + ("" if noise is None else f" (fp32 noise {noise:.2e})"))
    return err


QV_VARIANTS = [  # preset, flags: sym and asym, group 32 and -1, a user exclusion splitting qkv
    ("tiny", ["--group-size", "32"]),
    ("tiny", ["--group-size", "32", "--asym", "--exclude", r".*self_attn\.k_proj$"]),
    ("gqa1", ["--group-size", "-1"]),
    ("mixed", ["--group-size", "-1", "--asym"]),
]


@pytest.mark.parametrize("preset,flags", QV_VARIANTS, ids=lambda v: v if isinstance(v, str) else "".join(v))
def test_qv_quantize_matches_transformers_on_dequantized(tiny_dirs, tmp_path, preset, flags):
    src = tiny_dirs(preset)
    out = tmp_path / "gptq"
    assert qv_main(["quantize", str(src), str(out), "--method", "rtn", *flags]) == 0
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    group = int(flags[flags.index("--group-size") + 1])
    assert (q["quant_method"], q["bits"], q["group_size"], q["sym"], q["desc_act"], q["checkpoint_format"]) == (
        "gptq", 8, group, "--asym" not in flags, False, "gptq")
    t, orig = read_all(out), read_all(src)
    quantized = {n.removesuffix(".qweight") for n in t if n.endswith(".qweight")}
    for name, w in orig.items():  # the documented default exclusions stay dense, everything else is int8
        module = name.removesuffix(".weight")
        keep = (w.dim() != 2 or re.search(r"embed_tokens|lm_head|in_proj_[ab]$|^model\.visual\.", module)
                or ("--exclude" in flags and module.endswith("self_attn.k_proj")))
        assert (module not in quantized) == bool(keep), module
        if keep:
            assert torch.equal(t[name], w), name
            if w.dim() == 2:  # every excluded linear has a "-:" rule
                assert any(re.match(k[2:], module) for k in q["dynamic"]), module
            continue
        assert t[f"{module}.qweight"].dtype == torch.int32 and t[f"{module}.scales"].dtype == torch.float16
        # round-to-nearest: every weight within ~half a step of its dequantized value (a writer
        # emitting consistent garbage would pass the logits comparison below, not this)
        deq, s = dequantize(t, module, "gptq"), t[f"{module}.scales"].double()[t[f"{module}.g_idx"].long()].t()
        assert ((deq - w.double()).abs() <= 0.6 * s).all(), module
    assert quantized and (tmp_path / "gptq" / "tokenizer.json").is_file()
    compare(out, tmp_path, f"qv quantize {preset} {' '.join(flags)}")


def test_independent_v1_asym_desc_act_ff_zeros(tiny_dirs, tmp_path):
    """Every linear incl. in_proj_a/b and lm_head quantized; act-order g_idx; 0xFF v1 zero bytes."""
    out = write_independent(tiny_dirs("tiny"), tmp_path / "ind-v1", quantize=r"^(?!model\.visual\.)(?!.*embed)",
                            fmt="gptq", sym=False, group=32, desc_act=True, scale_dtype=torch.float16,
                            qcfg_extra={"lm_head": True, "dynamic": {"-:.*visual.*": {}}}, shards=1, seed=1,
                            ff_zeros=True)
    t = read_all(out)
    assert "lm_head.qweight" in t and any(n.endswith("in_proj_a.qweight") for n in t)
    assert any((unpack(v, 1) == 0xFF).any() for n, v in t.items() if n.endswith(".qzeros"))  # case exercised
    compare(out, tmp_path, "independent v1 asym desc_act")


def test_independent_v2_sym_sharded_mixed(tiny_dirs, tmp_path):
    """gptq_v2, bf16 scales, 3 shards; k_proj dense via modules_to_not_convert, in_proj_a/b dense via
    a rule on vLLM's fused name, o_proj dense with no rule (no fused sibling: allowed)."""
    rules = {"dynamic": {r"-:.*linear_attn\.in_proj_ba$": {}}, "modules_to_not_convert": ["k_proj"]}
    for seed in (2, 3):  # seed 3 keeps qzeros, seed 2 omits them (both legal for v2 sym)
        out = write_independent(tiny_dirs("gqa1"), tmp_path / f"ind-v2-{seed}",
                                quantize=r"(mlp|in_proj_qkv|in_proj_z|out_proj|q_proj|v_proj)$", fmt="gptq_v2",
                                sym=True, group=16, desc_act=True, scale_dtype=torch.bfloat16, qcfg_extra=rules,
                                shards=3, seed=seed)
        compare(out, tmp_path, f"independent v2 sym sharded (qzeros {'kept' if seed % 2 else 'omitted'})")


def test_make_tiny_gptq_in_place_and_sharded_output(tmp_path, tiny_dirs):
    assert qv_main(["make-tiny", str(tmp_path / "mt"), "--gptq"]) == 0
    assert any(n.endswith(".qweight") for n in read_all(tmp_path / "mt"))
    assert not list((tmp_path / "mt").glob(".qv-tmp*"))
    from qv.model.quantize import quantize_checkpoint

    one = quantize_checkpoint(tiny_dirs("gqa1"), tmp_path / "one", group_size=16)
    many = quantize_checkpoint(tiny_dirs("gqa1"), tmp_path / "many", group_size=16, shard_bytes=4096)
    assert (many / "model.safetensors.index.json").is_file() and len(list(many.glob("*.safetensors"))) > 2
    a, b = read_all(one), read_all(many)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    load_text_model(str(many))
    for shard_bytes in (4096, 1 << 30):  # in place over a 3-shard source: into many shards, into one file
        src = shutil.copytree(tiny_dirs("gqa1"), tmp_path / f"ip{shard_bytes}")
        (src / "model.safetensors").unlink()
        names = sorted(orig := read_all(tiny_dirs("gqa1")))
        for i in range(3):
            save_file({k: orig[k] for k in names[i::3]}, str(src / f"model-{i + 1:05d}-of-00003.safetensors"))
        (src / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": {k: f"model-{i % 3 + 1:05d}-of-00003.safetensors" for i, k in enumerate(names)}}))
        quantize_checkpoint(src, src, group_size=16, in_place=True, shard_bytes=shard_bytes)
        c = read_all(src)  # every file in the folder: stale dense shards would add keys or clash
        assert c.keys() == a.keys() and all(torch.equal(a[k], c[k]) for k in a)
        assert (src / "model.safetensors.index.json").is_file() == (shard_bytes == 4096)
        load_text_model(str(src))


@pytest.mark.parametrize("kwargs,needle", [
    ({"bits": 3}, "--bits 3"),
    ({"bits": 4, "group_size": 20}, "multiples of 8"),
    ({"group_size": 0}, "--group-size 0"),
    ({"group_size": 64}, "model.language_model.layers.0.mlp.down_proj"),  # K = 160
    ({"exclude": ["(unclosed"]}, "(unclosed"),
])
def test_quantize_errors_name_the_cause(tiny_dirs, tmp_path, kwargs, needle):
    from qv.model.quantize import quantize_checkpoint

    with pytest.raises(ConfigError) as e:
        quantize_checkpoint(tiny_dirs("tiny"), tmp_path / "o", **kwargs)
    assert needle in str(e.value)
    assert not (tmp_path / "o").exists()  # failed before writing anything


def test_quantize_refuses_quantized_or_occupied(tiny_dirs, tmp_path):
    from qv.model.quantize import quantize_checkpoint

    done = quantize_checkpoint(tiny_dirs("gqa1"), tmp_path / "q", group_size=16)
    with pytest.raises(ConfigError, match="already quantized"):
        quantize_checkpoint(done, tmp_path / "q2")
    with pytest.raises(ConfigError, match="already holds a checkpoint"):
        quantize_checkpoint(tiny_dirs("gqa1"), done, group_size=16)
    copy = shutil.copytree(tiny_dirs("gqa1"), tmp_path / "c")
    with pytest.raises(ConfigError, match="in_place"):
        quantize_checkpoint(copy, copy, group_size=16)
