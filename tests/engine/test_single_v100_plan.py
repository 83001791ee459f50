"""The single-V100 plan (issue 41): `qv serve --dry-run` of the 27B (the `qv bench --preset 27b` config)
with random GPTQ-Int4 weights, planned for one 32 GB V100 (device_memory_bytes = 32,510 MiB, what a
V100-SXM2-32GB reports; fp16 activations as on Volta) with int8 KV and int16 GDN state, holds one
262,144-token sequence; the same plan with GPTQ-Int8 weights does not (the original needs two cards).
CPU only: the dry run reads no weight."""

from __future__ import annotations

import re

from qv.bench.presets import write_preset
from qv.cli import main
from qv.config import EngineConfig
from qv.engine.preflight import preflight

V100_32GB = 32510 << 20
CONTEXT = 262144
LEVERS = dict(load_format="random", dtype="float16", kv_dtype="int8", gdn_state_dtype="int16",
              max_model_len=CONTEXT, max_num_seqs=1, prefix_caching=False, device_memory_bytes=V100_32GB,
              device="cpu")


def _flags(levers: dict) -> list[str]:
    return [x for k, v in levers.items() for x in (f"--{k.replace('_', '-')}", str(v).lower() if isinstance(v, bool)
                                                   else str(v))]


def test_27b_gptq_int4_holds_262k_on_one_v100(tmp_path, capsys):
    folder = write_preset("27b", tmp_path / "27b")
    levers = dict(LEVERS, quantization="gptq-int4")
    assert main(["serve", str(folder), "--dry-run", "--port", "0", *_flags(levers)]) == 0
    out = capsys.readouterr().out
    assert f"holds 1 sequence(s) of {CONTEXT:,} tokens" in out and "the plan fits" in out
    plan = preflight(EngineConfig(model=str(folder), **levers), check_port=False).plan
    assert plan.device_bytes == V100_32GB and plan.longest_context == CONTEXT and plan.seqs_at_longest == 1
    gib = 1 << 30
    # 4-bit codes + fp16 scales of the linears, the fp16 embedding and lm_head (5 GB of it) and the norms
    assert 16 * gib < plan.weight_bytes < 17 * gib
    # int8 KV: 16 attention layers x 4 KV heads x 256 x 2 bytes + fp32 scales = 33,280 bytes a token
    assert plan.kv_block_bytes == 16 * 33280 and plan.kv_tokens >= CONTEXT
    assert plan.gdn_slot_bytes < 100 << 20  # int16 GDN state of one sequence: 48 layers, about 76 MB
    print(re.search(r"memory plan .*", out).group(0))


def test_27b_gptq_int8_does_not_fit_one_v100(tmp_path):
    folder = write_preset("27b", tmp_path / "27b")
    check = preflight(EngineConfig(model=str(folder), **dict(LEVERS, quantization="gptq-int8")), check_port=False)
    assert check.plan.weight_bytes > 27 << 30 and check.plan.longest_context < 32768
