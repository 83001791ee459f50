"""`qv bench` end to end on the CPU at tiny scale: every requested row is in the table and the
JSON, each floor is its bytes over the copy rate (decode) or its FLOPs over the matmul rate
(prefill), and those bytes and FLOPs agree with what the loaded engine really holds (its tensors'
and caches' sizes) and with the checkpoint's parameter counts, counted here without qv/bench.
No timing is asserted."""

from __future__ import annotations

import json
import math

import pytest

from qv.cli import main
from qv.config import EngineConfig
from qv.kernels.linear import GPTQWeight

ROW_KEYS = ("kind", "batch", "tokens", "measured_s", "floor_s", "floor_ratio", "weight_bytes", "kv_bytes",
            "state_bytes", "flops", "tokens_per_s")
TOP_KEYS = ("copy_bytes_per_s", "matmul_flops_per_s", "gpu", "versions", "date", "start_s",
            "peak_memory_allocated_bytes", "peak_memory_reserved_bytes", "cuda_graphs", "levers", "memory_plan",
            "rows", "profile")


def _bench(tmp_path, capsys, *args: str) -> tuple[dict, str]:
    out = tmp_path / "bench.json"
    assert main(["bench", *args, "--steps", "2", "--warmup", "1", "--json", str(out)]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out


def _check_report(report: dict, text: str, expected_rows: set[tuple[str, int, int]]) -> None:
    for key in TOP_KEYS:
        assert key in report, key
    assert report["copy_bytes_per_s"] > 0 and report["matmul_flops_per_s"] > 0 and report["start_s"] > 0
    assert {(r["kind"], r["batch"], r["tokens"]) for r in report["rows"]} == expected_rows
    assert len(report["rows"]) == len(expected_rows)
    for r in report["rows"]:
        for key in ROW_KEYS:
            assert key in r, key
        for key in ("measured_s", "floor_s", "floor_ratio", "weight_bytes", "flops", "tokens_per_s"):
            assert r[key] > 0, (key, r)
        assert r["floor_ratio"] == pytest.approx(r["floor_s"] / r["measured_s"], rel=1e-9)
        work = r["batch"] if r["kind"] == "decode" else r["tokens"]
        assert r["tokens_per_s"] == pytest.approx(work / r["measured_s"], rel=1e-9)
        if r["kind"] == "decode":
            moved = r["weight_bytes"] + r["kv_bytes"] + r["state_bytes"]
            assert r["floor_s"] == pytest.approx(moved / report["copy_bytes_per_s"], rel=1e-12)
            assert r["kv_bytes"] > 0 and r["state_bytes"] > 0 and r["context_read"] >= r["tokens"]
        else:
            assert r["floor_s"] == pytest.approx(r["flops"] / report["matmul_flops_per_s"], rel=1e-12)
    table = [line for line in text.splitlines() if line.startswith(("| decode", "| prefill"))]
    assert len(table) == len(expected_rows), text
    assert "ceilings measured in this run" in text and "levers:" in text


# -- what the engine holds, counted from its objects -------------------------------------------


def _weight_bytes(model) -> int:
    """Bytes of every tensor a forward reads, the embedding table aside (B rows are added apart)."""
    seen: dict[int, int] = {}

    def add(*tensors):
        for t in tensors:
            if t is not None:
                seen[t.data_ptr()] = t.numel() * t.element_size()

    def linear(lin):
        w = lin.weight
        if isinstance(w, GPTQWeight):
            add(w.qweight, w.scales, w.zeros)  # g_idx is not read for sequential groups
        else:
            add(w)
        add(lin.bias)

    for layer in model.layers:
        add(layer.input_norm, layer.post_norm)
        m = layer.mixer
        if layer.kind == "full_attention":
            for lin in m.qkv.parts + [m.o_proj]:
                linear(lin)
            add(m.q_norm, m.k_norm)
        else:
            for lin in m.in_proj.parts + [m.out_proj]:
                linear(lin)
            add(m.conv_weight, m.A_log, m.dt_bias, m.norm_weight)
        for lin in layer.mlp.gate_up.parts + [layer.mlp.down]:
            linear(lin)
    add(model.norm)
    linear(model.lm_head)  # tied: the embedding table, read whole by the logits
    return sum(seen.values())


def _cache_bytes(cache) -> tuple[int, int]:
    """(KV bytes of one token across the attention layers, GDN state bytes of one sequence)."""
    kv = sum(2 * (c.k[0, 0].numel() * c.k.element_size()
                  + (c.k_scale[0, 0].numel() * c.k_scale.element_size() if c.k_scale is not None else 0))
             for c in cache.kv.values())
    state = sum(s.conv[0].numel() * s.conv.element_size() + s.ssm[0].numel() * s.ssm.element_size()
                + (s.ssm_scale[0].numel() * s.ssm_scale.element_size() if s.ssm_scale is not None else 0)
                for s in cache.gdn.values())
    return kv, state


def _prefill_flops(config: dict, tokens: int) -> int:
    from qv.model.tiny import tensor_shapes

    t = config.get("text_config", config)
    shapes = tensor_shapes(config)
    matrices = {n: math.prod(s) for n, s in shapes.items() if len(s) == 2 and "visual" not in n}
    embed = next(n for n in matrices if n.endswith("embed_tokens.weight"))
    lm_head = matrices.get("lm_head.weight", matrices[embed])
    body = sum(p for n, p in matrices.items() if n not in (embed, "lm_head.weight"))
    kinds = t["layer_types"]
    attn = kinds.count("full_attention") * 2 * tokens**2 * t["head_dim"] * t["num_attention_heads"]
    gdn = kinds.count("linear_attention") * 6 * tokens * (
        t["linear_num_value_heads"] * t["linear_key_head_dim"] * t["linear_value_head_dim"])
    return 2 * tokens * body + 2 * lm_head + attn + gdn


def _check_against_engine(report: dict, model_dir, config: dict) -> None:
    from qv.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig.from_env(environ={}, model=str(model_dir), **report["levers"]))
    weights = _weight_bytes(engine.runner.model)
    row_bytes = engine.runner.model.embed_tokens[0].numel() * engine.runner.model.embed_tokens.element_size()
    kv_per_token, state_per_seq = _cache_bytes(engine.runner.cache)
    for r in report["rows"]:
        if r["kind"] == "decode":
            assert r["weight_bytes"] == weights + r["batch"] * row_bytes
            assert r["kv_bytes"] == round(kv_per_token * r["batch"] * r["context_read"])
            assert r["state_bytes"] == 2 * r["batch"] * state_per_seq  # read and written
        else:
            assert r["flops"] == _prefill_flops(config, r["tokens"])


def test_bench_preset_tiny(tmp_path, capsys):
    from qv.bench.presets import preset_config, write_preset

    report, text = _bench(tmp_path, capsys, "--preset", "tiny", "--batch-sizes", "1,2", "--contexts", "96",
                          "--prefill-lengths", "96,128")
    expected = {("decode", 1, 1024), ("decode", 2, 1024), ("decode", 1, 96), ("prefill", 1, 96), ("prefill", 1, 128)}
    _check_report(report, text, expected)
    assert report["levers"]["load_format"] == "random" and report["levers"]["max_num_seqs"] == 2
    assert report["cuda_graphs"] is False and report["profile"] == []
    folder = write_preset("tiny", tmp_path / "preset")
    _check_against_engine(report, folder, preset_config("tiny"))


def test_bench_model_folder_gptq_int8_kv(tmp_path, capsys):
    """A checkpoint folder (tied lm_head, GPTQ-Int8 linears), int8 KV and int16 GDN state: their
    scales count; --profile adds a per-kernel table at the smallest and largest batch."""
    from qv.model.quantize import quantize_checkpoint
    from qv.model.tiny import make_tiny

    folder = make_tiny(tmp_path / "gqa1", "gqa1")
    quantize_checkpoint(folder, folder, bits=8, group_size=16, sym=True, in_place=True)
    report, text = _bench(tmp_path, capsys, str(folder), "--batch-sizes", "1,3", "--batch-context", "40",
                          "--contexts", "64", "--prefill-lengths", "48", "--kv-dtype", "int8",
                          "--gdn-state-dtype", "int16", "--profile")
    expected = {("decode", 1, 40), ("decode", 3, 40), ("decode", 1, 64), ("prefill", 1, 48)}
    _check_report(report, text, expected)
    assert "load_format" not in report["levers"] and report["levers"]["kv_dtype"] == "int8"
    # decode steps at the smallest and largest batch, then the longest prefill's last chunk
    assert [(p["kind"], p["batch"], p["context"]) for p in report["profile"]] == [
        ("decode", 1, 40), ("decode", 3, 40), ("prefill", 1, 48)]
    for p in report["profile"]:
        assert p["kernels"] and p["wall_us_per_step"] > 0
    assert text.count("| kernel | us/step |") == 3 and "the last prefill chunk of a 48-token prompt" in text
    _check_against_engine(report, folder, json.loads((folder / "config.json").read_text()))


def test_bench_model_folder_gptq_int4(tmp_path, capsys):
    """A GPTQ-Int4 folder (asymmetric): the rows count two codes a byte, and the zeros."""
    from qv.model.quantize import quantize_checkpoint
    from qv.model.tiny import make_tiny

    folder = make_tiny(tmp_path / "gqa1", "gqa1")
    quantize_checkpoint(folder, folder, bits=4, group_size=16, sym=False, in_place=True)
    report, text = _bench(tmp_path, capsys, str(folder), "--batch-sizes", "1,2", "--batch-context", "40",
                          "--contexts", "64", "--prefill-lengths", "48")
    _check_report(report, text, {("decode", 1, 40), ("decode", 2, 40), ("decode", 1, 64), ("prefill", 1, 48)})
    _check_against_engine(report, folder, json.loads((folder / "config.json").read_text()))


def test_bench_rows_need_a_long_enough_model(tmp_path, capsys):
    from qv.config import ConfigError

    with pytest.raises(ConfigError, match="max_model_len"):  # --debug: the CLI raises instead of printing one line
        main(["--debug", "bench", "--preset", "tiny", "--batch-sizes", "1", "--contexts", "64", "--prefill-lengths", "64",
              "--max-model-len", "32", "--steps", "1"])


def test_bench_spec_ngram_parts(tmp_path, capsys):
    """--spec ngram adds each decode row's parts (plain, verification, lookups, backed off) and the prefill
    without and with speculation, in the JSON and as a table."""
    report, text = _bench(tmp_path, capsys, "--preset", "tiny", "--batch-sizes", "1,2", "--contexts", "64",
                          "--prefill-lengths", "64", "--spec", "ngram")
    assert {(r["batch"], r["context"]) for r in report["spec"]} == {(1, 1024), (2, 1024), (1, 64)}
    for r in report["spec"]:
        assert r["source"] == "ngram" and r["acceptance_length"] == 3.6
        for key in ("plain_s", "spec_step_s", "verify_s", "draft_s", "backed_off_s"):
            assert r[key] > 0, (key, r)
        assert r["projected_tokens_per_s"] == pytest.approx(3.6 * r["batch"] / r["spec_step_s"])
    assert [p["tokens"] for p in report["spec_prefill"]] == [64] and report["spec_prefill"][0]["plain_s"] > 0
    assert "speculative decoding (ngram)" in text and "| prefill | without speculation |" in text


def test_bench_peer_tables(tmp_path, capsys):
    """--linears and --attention: every linear of a layer at every row count and each context, beside its peer
    and floor, in the JSON and as tables (the CPU checks completeness only: no timing is asserted)."""
    from qv.bench.peers import CPU_ATTENTION_CONTEXTS, CPU_LINEAR_ROWS, layer_linears
    from qv.bench.presets import preset_config
    from qv.model_config import ModelConfig

    report, text = _bench(tmp_path, capsys, "--preset", "tiny", "--batch-sizes", "1", "--contexts", "",
                          "--prefill-lengths", "64", "--linears", "--attention")
    names = [name for name, _, _ in layer_linears(ModelConfig.from_dict(preset_config("tiny")))]
    assert [(r["linear"], r["m"]) for r in report["linears"]] == [
        (name, m) for m in CPU_LINEAR_ROWS for name in names + ["sum"]]
    for m in CPU_LINEAR_ROWS:
        rows = [r for r in report["linears"] if r["m"] == m]
        assert rows[-1]["qv_ms"] == pytest.approx(sum(r["qv_ms"] for r in rows[:-1]))
    for r in report["linears"] + report["attention"]:
        assert all(r[k] > 0 for k in r if k.endswith("_ms")), r
    assert [r["context"] for r in report["attention"]] == list(CPU_ATTENTION_CONTEXTS)
    assert text.count("| linear | M |") == 1 and text.count("| context | chunk |") == 1
    assert text.count("| **sum** |") == len(CPU_LINEAR_ROWS)


def test_v100_model_single_card_int4():
    """bench/v100_model.py's one-V100 GPTQ-Int4 deployment: the whole model's 4-bit codes on one card (the
    two-card int8 deployment reads half its int8 codes a card), no all-reduces, a slower prefill than two cards."""
    import importlib.util
    import sys
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("v100_model", Path(__file__).parents[1] / "bench" / "v100_model.py")
    v = importlib.util.module_from_spec(spec)
    sys.modules["v100_model"] = v  # its dataclasses look their module up there
    spec.loader.exec_module(v)
    one, two = v.decode_parts(32768, tp=1, bits=4), v.decode_parts(32768, tp=2, bits=8)
    assert abs(one[0].bytes / two[0].bytes - (0.5 + 2 / 128) / (1 + 2 / 128) * 2) < 1e-9
    assert not any("all-reduce" in p.kernel for p in one + v.prefill_parts(1000, tp=1, bits=4))
    single, pair = v.predict(tp=1, bits=4), v.predict(tp=2, bits=8)
    assert single["prefill_250k_s"] > pair["prefill_250k_s"]
    assert all(single["decode"][c]["tokens_per_s"] > 0 for c in v.ORIGINAL_TOKENS_PER_S)
