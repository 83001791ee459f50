"""The memory plan under tensor parallelism (issue 35): every figure is one rank's. Rank 0's weights counted
from the config's shapes match what load_text_model's shard holds; the KV blocks and GDN slots are sized
from the rank's heads. The original's deployment (the 27B GPTQ-Int8 on two 32 GB V100s, int8 KV, int16 GDN
state) plans one 262,144-token sequence at tensor parallel 2, not at 1; where a plan cannot hold one
max_model_len sequence, the dry run names the lever that would make it fit. CPU only: no weight is read."""

from __future__ import annotations

import re

import pytest
import torch

from qv.bench.presets import write_preset
from qv.cli import main
from qv.config import EngineConfig
from qv.engine.preflight import preflight, weight_bytes
from qv.model.cache import gdn_bytes_per_slot, kv_bytes_per_block
from qv.model.parallel import TPGroup, rank_config
from qv.model.quantize import quantize_checkpoint
from qv.model.qwen3_5 import held_bytes, load_text_model
from qv.model_config import ModelConfig

V100_32GB = 32510 << 20
CONTEXT = 262144
LEVERS = dict(load_format="random", quantization="gptq-int8", dtype="float16", kv_dtype="int8",
              gdn_state_dtype="int16", max_model_len=CONTEXT, max_num_seqs=1, prefix_caching=False,
              device_memory_bytes=V100_32GB, device="cpu")


def _flags(levers: dict) -> list[str]:
    return [x for k, v in levers.items() for x in (f"--{k.replace('_', '-')}", str(v).lower() if isinstance(v, bool)
                                                   else str(v))]


@pytest.mark.parametrize("quantized", [False, True], ids=["dense", "gptq-int8"])
def test_rank_weights_counted_from_shapes_are_the_shards(tiny_dirs, tmp_path, quantized):
    """Rank 0's shard as load_text_model cuts it (column, row, vocabulary, per-head) holds what
    weight_bytes(world=2) counts, within 1%, and about half of the whole model's linears."""
    folder = tiny_dirs("gqa1")
    if quantized:
        folder = quantize_checkpoint(folder, tmp_path / "q", bits=8, group_size=16, sym=True)
    mcfg = ModelConfig.from_dir(folder)
    whole = held_bytes(load_text_model(str(folder)))
    shard = held_bytes(load_text_model(str(folder), tp=TPGroup(rank=0, world_size=2)))
    counted = weight_bytes(mcfg, torch.float32, mtp=False, media=False, world=2)
    assert abs(counted - shard) <= 0.01 * shard, (counted, shard)
    assert abs(weight_bytes(mcfg, torch.float32, mtp=False, media=False) - whole) <= 0.01 * whole
    assert 0.45 * whole < shard < 0.7 * whole  # norms are replicated, everything else halves


def test_27b_gptq_int8_holds_262k_on_two_v100s(tmp_path, capsys):
    folder = write_preset("27b", tmp_path / "27b")
    levers = dict(LEVERS, tensor_parallel_size=2)
    assert main(["serve", str(folder), "--dry-run", "--port", "0", *_flags(levers)]) == 0
    out = capsys.readouterr().out
    assert "memory plan per rank (tensor parallel 2)" in out
    assert f"holds 1 sequence(s) of {CONTEXT:,} tokens" in out and "the plan fits" in out and "does not fit" not in out
    plan = preflight(EngineConfig(model=str(folder), **levers), check_port=False).plan
    one = preflight(EngineConfig(model=str(folder), **LEVERS), check_port=False).plan
    gib = 1 << 30
    assert plan.device_bytes == V100_32GB and plan.tensor_parallel_size == 2 and plan.seqs_at_longest == 1
    assert plan.longest_context == CONTEXT and plan.kv_tokens >= CONTEXT and CONTEXT % plan.block_size == 0
    # rank 0's shard: half the linears, half the vocabulary of the embedding and lm_head
    assert 13 * gib < plan.weight_bytes < 15 * gib
    assert abs(plan.weight_bytes - one.weight_bytes / 2) < 0.02 * one.weight_bytes
    # int8 KV of the rank's 2 of 4 KV heads: 16 layers x 2 heads x (256 + 4-byte scale) x K and V a token
    mcfg = rank_config(ModelConfig.from_dir(folder), 2)
    assert plan.kv_block_bytes == 16 * 2 * 2 * 260 * plan.block_size == kv_bytes_per_block(mcfg, plan.block_size,
                                                                                           torch.int8)
    # int16 GDN state of the rank's 24 of 48 value heads, a pool apart from the KV blocks (no padding to a page)
    assert plan.gdn_slot_bytes == gdn_bytes_per_slot(mcfg, torch.float16, torch.int16) == one.gdn_slot_bytes // 2
    # the same levers at tensor parallel 1 do not hold it, and the plan says which lever would
    assert one.longest_context < 32768
    print(re.search(r"memory plan .*", out).group(0))


def test_a_plan_that_does_not_fit_names_the_lever(tmp_path, capsys):
    folder = write_preset("27b", tmp_path / "27b")
    assert main(["serve", str(folder), "--dry-run", "--port", "0", *_flags(LEVERS)]) == 0
    hint = next(line for line in capsys.readouterr().out.splitlines() if "does not fit" in line)
    assert hint.startswith(f"one {CONTEXT:,}-token sequence (max_model_len) does not fit (the KV blocks hold")
    assert "tensor_parallel_size=2" in hint and "quantization=gptq-int4" in hint
    # each named lever really makes it fit
    for change in (dict(tensor_parallel_size=2), dict(quantization="gptq-int4")):
        check = preflight(EngineConfig(model=str(folder), **dict(LEVERS, **change)), check_port=False)
        assert check.plan.kv_tokens >= CONTEXT and not check.fit_hint
    # at tensor parallel 2 with fp16 KV, fp32 state, prefix snapshots and 64 sequences, the original's levers
    levers = dict(LEVERS, tensor_parallel_size=2, kv_dtype="fp16", gdn_state_dtype="fp32", prefix_caching=True,
                  max_num_seqs=64)
    check = preflight(EngineConfig(model=str(folder), **levers), check_port=False)
    assert check.plan.kv_tokens < CONTEXT and "it would with" in check.fit_hint
    named = re.findall(r"(\w+)=", check.fit_hint.split("it would with", 1)[1])
    assert named and set(named) <= {"kv_dtype", "gdn_state_dtype", "prefix_caching", "max_num_seqs",
                                    "gpu_memory_utilization", "tensor_parallel_size", "quantization"}
    # a context no lever reaches says so
    small = dict(LEVERS, device_memory_bytes=16 << 30, quantization="gptq-int8")
    check = preflight(EngineConfig(model=str(folder), **small), check_port=False)
    assert "does not fit" in check.fit_hint
