"""Calibrated GPTQ (qv/model/gptq.py) and `qv quantize --method gptq / --lm-head` (qv/model/quantize.py).

One weight: with an identity Hessian GPTQ has no error to spread and must equal round-to-nearest code for
code; under a correlated Hessian its output error tr(D H D^T) must be well below round-to-nearest's (a GPTQ
that rounded to nearest fails), at 8 and 4 bits, symmetric and asymmetric, with and without activation order
and static groups; the permuted g_idx is consistent with the codes. A whole checkpoint: the GPTQ folder in
the standard layout (shapes and dtypes vLLM's GPTQ loader reads, desc_act with a permuted g_idx), its logits
in qv against transformers on the test's own dequantization (tests/test_quantize.py), and --lm-head's
row-int8 lm_head loaded by qv as the int8 head QV_LM_HEAD_INT8 makes. The calibration set's sources and
errors. GPTQ's logit error against RTN's on the fitted tiny model is in tests/spec/test_gptq_fitted.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from qv.cli import main as qv_main
from qv.config import ConfigError
from qv.kernels.lm_head_top1 import is_row_int8
from qv.model.gptq import BUILTIN_TEXT, QuantizedWeight, calibration_ids, calibration_texts, gptq_quantize
from qv.model.quantize import quantize_checkpoint, rtn_quantize
from qv.model.qwen3_5 import load_text_model
from hf_oracle import assert_matches_hf
from test_quantize import read_all


def _correlated(k: int, tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs with a few strong directions and channel scales spread over 100x, and their Hessian."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.randn(8, k, generator=g)
    x = torch.randn(tokens, 8, generator=g) @ basis + 0.3 * torch.randn(tokens, k, generator=g)
    x = x * torch.logspace(-1, 1, k)[torch.randperm(k, generator=g)]
    return x, 2 * x.t() @ x / tokens


def _output_error(w, q: QuantizedWeight, x) -> float:
    return float(((x @ (w - q.dequantize()).t()).norm() / (x @ w.t()).norm()))


@pytest.mark.parametrize("bits,sym", [(8, True), (4, True), (4, False), (8, False)])
def test_identity_hessian_is_round_to_nearest(bits, sym):
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(1)) * 0.05
    q = gptq_quantize(w, torch.eye(96), bits, 32, sym, damp=0.01, act_order=False)
    codes, scales, zeros = rtn_quantize(w, 32, sym, bits)
    assert torch.equal(q.codes, codes) and torch.equal(q.scales, scales) and torch.equal(q.zeros, zeros)
    assert torch.equal(q.g_idx, torch.arange(96, dtype=torch.int32) // 32)


@pytest.mark.parametrize("bits,sym,act_order,static", [
    (8, True, True, False), (4, True, True, False), (4, False, True, False), (4, True, False, False),
    (4, True, True, True), (8, False, False, False)])
def test_gptq_output_error_well_below_rtn(bits, sym, act_order, static):
    k, n = 128, 40
    x, h = _correlated(k, 512, seed=bits * 10 + sym)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(2)) * 0.05
    q = gptq_quantize(w, h, bits, 32, sym, damp=0.01, act_order=act_order, static_groups=static)
    codes, scales, zeros = rtn_quantize(w, 32, sym, bits)
    rtn = QuantizedWeight(codes, scales, zeros, torch.arange(k, dtype=torch.int32) // 32)
    ours, base = _output_error(w, q, x), _output_error(w, rtn, x)
    print(f"bits {bits} sym {sym} act_order {act_order} static {static}: gptq {ours:.3e} rtn {base:.3e}")
    assert ours < 0.7 * base
    top = (1 << bits) - 1
    assert int(q.codes.max()) <= top and q.scales.dtype == torch.float16 and q.zeros.dtype == torch.int32
    assert sorted(torch.bincount(q.g_idx.long()).tolist()) == [32] * 4  # every group holds group_size inputs
    sequential = torch.equal(q.g_idx, torch.arange(k, dtype=torch.int32) // 32)
    assert sequential == (static or not act_order)


def test_dead_inputs_and_one_group():
    k = 64
    x, h = _correlated(k, 256, seed=4)
    h[5, :] = h[:, 5] = 0  # an input never active
    w = torch.randn(16, k, generator=torch.Generator().manual_seed(3)) * 0.05
    q = gptq_quantize(w, h, 8, -1, True)
    assert q.scales.shape == (1, 16) and (q.g_idx == 0).all()
    assert (q.dequantize()[:, 5] == 0).all()
    assert torch.isfinite(q.dequantize()).all()


def test_calibration_sources(tmp_path):
    assert len(calibration_texts(None)) > 10 and calibration_texts(None)[0] in BUILTIN_TEXT
    (tmp_path / "c.jsonl").write_text('{"text": "alpha beta"}\n\n{"text": "gamma"}\n')
    assert calibration_texts(str(tmp_path / "c.jsonl")) == ["alpha beta", "gamma"]
    (tmp_path / "c.txt").write_text("one\n\ntwo\nlines\n\n\n")
    assert calibration_texts(str(tmp_path / "c.txt")) == ["one", "two\nlines"]
    for body, needle in (('{"text": 3}\n', "line 1"), ("not json\n", "not JSON"), ("", "no text")):
        (tmp_path / "bad.jsonl").write_text(body)
        with pytest.raises(ConfigError, match=needle):
            calibration_texts(str(tmp_path / "bad.jsonl"))
    with pytest.raises(ConfigError, match="no such file"):
        calibration_texts(str(tmp_path / "missing.txt"))

    class Chars:  # a tokenizer of one id a character
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(c) % 251 for c in text]}

    ids = calibration_ids(Chars(), ["abc" * 50, "xyz" * 50], 6, 40, seed=1)
    assert ids.shape == (6, 40) and ids.dtype == torch.int64
    assert torch.equal(ids, calibration_ids(Chars(), ["abc" * 50, "xyz" * 50], 6, 40, seed=1))
    assert calibration_ids(Chars(), ["ab"], 2, 9).shape == (2, 9)  # a short text repeats


def _unpack(packed: torch.Tensor, bits: int, axis: int) -> torch.Tensor:
    """The test's own bit shifts: 32 / bits codes of an int32, code i at bits [i * bits, (i + 1) * bits)."""
    u = packed.numpy().view(np.uint32)
    per = 32 // bits
    parts = np.stack([(u >> (bits * i)) & ((1 << bits) - 1) for i in range(per)], axis=axis + 1)
    shape = (u.shape[0] * per, u.shape[1]) if axis == 0 else (u.shape[0], u.shape[1] * per)
    return torch.from_numpy(parts.reshape(shape).astype(np.int64))


def _dequantize(t: dict, module: str, bits: int) -> torch.Tensor:
    """float64 [N, K] of a v1 GPTQ module (stored zero + 1)."""
    q, z = _unpack(t[f"{module}.qweight"], bits, 0), _unpack(t[f"{module}.qzeros"], bits, 1) + 1
    g = t[f"{module}.g_idx"].long()
    return ((q - z[g]) * t[f"{module}.scales"].double()[g]).t()


def _compare_with_transformers(out, tmp_path, bits_of, label: str) -> None:
    """qv on the GPTQ folder vs transformers float64 on the test's own dense twin of it."""
    config = json.loads((out / "config.json").read_text())
    config.pop("quantization_config")
    t = read_all(out)
    dense = {}
    for name, v in t.items():
        if name.endswith(".qweight"):
            module = name.removesuffix(".qweight")
            dense[f"{module}.weight"] = _dequantize(t, module, bits_of(module)).float().contiguous()
        elif not name.endswith((".qzeros", ".scales", ".g_idx")):
            dense[name] = v
    twin = tmp_path / "dense-twin"
    twin.mkdir()
    save_file(dense, str(twin / "model.safetensors"), metadata={"format": "pt"})
    (twin / "config.json").write_text(json.dumps(config))
    ids = torch.randint(0, config.get("text_config", config)["vocab_size"], (29,),
                        generator=torch.Generator().manual_seed(11))
    err, noise = assert_matches_hf(out, twin, ids, label)
    print(f"{label}: rel err {err:.2e}")


def _gptq_flags(*extra):
    return ["--method", "gptq", "--num-samples", "8", "--seq-len", "48", "--device", "cpu", *extra]


@pytest.mark.parametrize("preset,flags", [
    ("tiny", ["--group-size", "32", "--dynamic-groups"]),
    ("tiny", ["--group-size", "32", "--bits", "4", "--asym", "--lm-head"]),
    ("gqa1", ["--group-size", "-1", "--no-act-order"]),
])
def test_gptq_checkpoint_layout_and_logits_against_transformers(tiny_dirs, tmp_path, preset, flags):
    src = tiny_dirs(preset)
    out = tmp_path / "gptq"
    assert qv_main(["quantize", str(src), str(out), *_gptq_flags(*flags)]) == 0
    config = json.loads((out / "config.json").read_text())
    q = config["quantization_config"]
    bits = int(flags[flags.index("--bits") + 1]) if "--bits" in flags else 8
    group = int(flags[flags.index("--group-size") + 1])
    act = "--no-act-order" not in flags and "--dynamic-groups" in flags and group != -1
    assert (q["quant_method"], q["bits"], q["group_size"], q["desc_act"], q["checkpoint_format"]) == (
        "gptq", bits, group, act, "gptq")
    t = read_all(out)
    pack = 32 // bits
    layers = [n.removesuffix(".qweight") for n in t if n.endswith(".qweight") and ".layers." in n]
    assert layers
    permuted = 0
    for m in layers:  # the standard layout vLLM's GPTQ loader reads
        qw, qz, sc, gi = t[f"{m}.qweight"], t[f"{m}.qzeros"], t[f"{m}.scales"], t[f"{m}.g_idx"]
        k, n = gi.shape[0], sc.shape[1]
        groups = 1 if group == -1 else k // group
        assert (qw.dtype, qz.dtype, sc.dtype, gi.dtype) == (torch.int32, torch.int32, torch.float16, torch.int32)
        assert qw.shape == (k // pack, n) and qz.shape == (groups, n // pack) and sc.shape == (groups, n)
        assert sorted(torch.bincount(gi.long(), minlength=groups).tolist()) == [k // groups] * groups
        permuted += not torch.equal(gi.long(), torch.arange(k) // (k // groups))
    assert (permuted > 0) == act
    if "--lm-head" in flags:
        assert q["lm_head"] is True and t["lm_head.scales"].shape[0] == 1 and "lm_head.weight" not in t
        assert any(k.startswith("+:") and v.get("group_size") == -1 for k, v in q["dynamic"].items())
        deq = _dequantize(t, "lm_head", 8)
        w = read_all(src)["lm_head.weight"].double()
        assert ((deq - w).abs() <= t["lm_head.scales"].double()[0][:, None] / 2 * 1.001).all()
        assert is_row_int8(load_text_model(str(out)).lm_head.weight)
    _compare_with_transformers(out, tmp_path, lambda m: 8 if m == "lm_head" else bits,
                               f"qv quantize gptq {preset} {' '.join(flags)}")


def test_lm_head_flag_refuses_a_tied_head(tiny_dirs, tmp_path):
    with pytest.raises(ConfigError, match="no separate lm_head"):
        quantize_checkpoint(tiny_dirs("gqa1"), tmp_path / "o", group_size=-1, lm_head=True)
    with pytest.raises(ConfigError, match="--method 'nearest'"):
        quantize_checkpoint(tiny_dirs("gqa1"), tmp_path / "o", group_size=-1, method="nearest")


def test_gptq_needs_a_tokenizer(tiny_dirs, tmp_path):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(tiny_dirs("tiny"), src)
    for f in src.glob("tokenizer*"):
        f.unlink()
    with pytest.raises(ConfigError, match="has no tokenizer"):
        quantize_checkpoint(src, tmp_path / "o", group_size=32, method="gptq")


@pytest.mark.gpu
def test_gptq_27b_layers_fit_one_gpu_gpu(tmp_path):
    """Four 27B-shaped layers (three GDN, one attention; the real 248,320-row vocabulary) calibrated on one
    GPU at the default 128 x 512 tokens: the run is layer by layer, so the peak is one layer's worth whatever
    the depth; printed for docs/VALIDATION.md and bounded by an 80 GB card."""
    from safetensors.torch import save_file as save

    from qv.model.tiny import build_config, random_tensor, tensor_shapes, write_tokenizer
    from qv.model.tiny_tokenizer import tokenizer_json

    _, special = tokenizer_json()
    config = build_config("27b", 248320, special)
    config.update(num_hidden_layers=4, layer_types=config["layer_types"][:4], dtype="bfloat16")
    gen = torch.Generator().manual_seed(0)
    tensors = {n: random_tensor(n, s, gen, torch.bfloat16) for n, s in sorted(tensor_shapes(config).items())}
    src = tmp_path / "src"
    src.mkdir()
    save(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    (src / "config.json").write_text(json.dumps(config))
    write_tokenizer(src)
    lines = []
    quantize_checkpoint(src, tmp_path / "out", method="gptq", log=lines.append)
    summary = next(m for m in lines if m.startswith("GPTQ:"))
    print(summary)
    peak = float(summary.split("peak device memory ")[1].split(" GiB")[0])
    assert 0 < peak < 70
    model = load_text_model(str(tmp_path / "out"), device="cuda", dtype=torch.bfloat16)
    assert model.layers[0].mlp.down.weight.is_sequential()
