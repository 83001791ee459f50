"""The start-up memory plan (qv/engine/memory_plan.py) against what the engine really allocated and
does: KV blocks x block bytes is the bytes of the KV cache tensors (int8 scales included), (slots + 1)
x slot bytes the bytes of the GDN state tensors, snapshots x slot bytes the snapshot pool's,
weight_bytes the model's tensor storages counted here by walking its layers, and the capacity the
plan reports (longest context, sequences at it, context at every slot) is what the scheduler then
runs without preempting, and not a token more. CPU, reference kernels."""

from __future__ import annotations

import json
import random

import pytest
import torch

from qv import SamplingParams
from qv.engine.build import CPU_KV_BYTES
from qv.kernels.linear import GPTQWeight
from qv.model import tiny
from qv.model.cache import kv_bytes_per_block

# every dim a multiple of 128 (GPTQ group 128 on every text linear), tied embeddings: the lm_head
# shares the embedding's storage, which must be counted once
SHAPE_128 = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=32, linear_value_head_dim=32, partial_rotary_factor=0.25,
                 mrope_section=[2, 1, 1], tie_word_embeddings=True, vision=False, vocab_size=512)
CASES = {
    # the embedded tiny model (vision tower loaded), fp32 KV and state, 256 MiB CPU budget; its Clef head
    # off here (a Clef head's plan is tests/test_launcher.py's dry-run case)
    "tiny": dict(clef=False),
    "tiny-int8": dict(kv_dtype="int8", gdn_state_dtype="int16", kv_cache_bytes=6 << 20, clef=False),
    "random-gptq": dict(load_format="random", quantization="gptq-int8", kv_dtype="int8", max_num_seqs=8,
                        kv_cache_bytes=3 << 20),
}


@pytest.fixture(scope="module")
def random_dir(tmp_path_factory):
    """A folder with only the config.json of a 128-wide model (random GPTQ-Int8 weights)."""
    out = tmp_path_factory.mktemp("random-128")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(tiny.PRESETS, "plan-128", SHAPE_128)
        _, special = tiny.tokenizer_json()
        config = tiny.build_config("plan-128", 0, special)
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


@pytest.fixture(scope="module", params=sorted(CASES))
def llm(tiny_engine, request, random_dir):
    levers = dict(CASES[request.param])
    return tiny_engine(model=random_dir if request.param.startswith("random") else None, **levers)


# -- walking the model ourselves ---------------------------------------------------------------
def _linear(lin) -> list:
    w = lin.weight
    out = [w.qweight, w.scales, w.zeros, w.g_idx] if isinstance(w, GPTQWeight) else [w]
    bank = lin.bank
    return out + [lin.bias] + ([] if bank is None else [bank.a, bank.b, bank.b_off, bank.col, bank.width, bank.scale,
                                                        bank.slot_rows, bank.member_cols_t])


def _fused(f) -> list:
    return [t for p in f.parts for t in _linear(p)]


def model_tensors(model, tower=None) -> list[torch.Tensor]:
    """Every tensor the text model (and vision tower) computes with, from their layer structure."""
    out = [model.embed_tokens, model.norm] + _linear(model.lm_head)
    for layer in model.layers:
        m = layer.mixer
        out += [layer.input_norm, layer.post_norm] + _fused(layer.mlp.gate_up) + _linear(layer.mlp.down)
        if layer.kind == "full_attention":
            out += _fused(m.qkv) + _linear(m.o_proj) + [m.q_norm, m.k_norm]
        else:
            out += (_fused(m.in_proj) + _linear(m.out_proj)
                    + [m.conv_weight, m.A_log, m.dt_bias, m.norm_weight])
    if tower is not None:
        out += [tower.pos_embed, tower.inv_freq, *tower.merger_norm] + _linear(tower.patch_embed)
        out += _linear(tower.merger_fc1) + _linear(tower.merger_fc2)
        for b in tower.blocks:
            out += [*b.norm1, *b.norm2] + _linear(b.qkv) + _linear(b.proj) + _linear(b.fc1) + _linear(b.fc2)
    return [t for t in out if t is not None]


def storage_bytes(tensors) -> int:
    storages = {}
    for t in tensors:
        st = t.untyped_storage()
        storages[st.data_ptr()] = st.nbytes()
    return sum(storages.values())


def _gib(b: int) -> str:
    return f"{b / (1 << 30):.2f} GiB" if b >= 1 << 30 else f"{b / (1 << 20):.1f} MiB"


# -- the plan against the allocation -----------------------------------------------------------
def test_plan_matches_the_allocated_cache(llm):
    e, plan = llm.engine, llm.engine.memory_plan
    cache = e.runner.cache
    kv = [t for c in cache.kv.values() for t in (c.k, c.v, c.k_scale, c.v_scale) if t is not None]
    gdn = [t for s in cache.gdn.values() for t in (s.conv, s.ssm, s.ssm_scale) if t is not None]
    assert plan.kv_blocks == cache.num_blocks == e.blocks.num_blocks
    assert plan.block_size == cache.block_size == e.cfg.block_size
    assert plan.kv_blocks * plan.kv_block_bytes == plan.kv_bytes == sum(t.nbytes for t in kv)
    assert (e.cfg.kv_dtype == "int8") == any(c.k_scale is not None for c in cache.kv.values())
    assert (e.cfg.gdn_state_dtype == "int16") == any(s.ssm_scale is not None for s in cache.gdn.values())
    assert plan.gdn_slots == e.cfg.max_num_seqs and cache.num_slots == plan.gdn_slots + 1  # + the scratch slot
    assert (plan.gdn_slots + 1) * plan.gdn_slot_bytes == plan.gdn_bytes == sum(t.nbytes for t in gdn)
    snaps = e.prefix_cache.snaps.tensors if e.prefix_cache else []
    assert plan.snapshots * plan.gdn_slot_bytes == plan.snapshot_bytes == sum(t.nbytes for t in snaps)
    # the budget (CPU: kv_cache_bytes or 256 MiB) goes to blocks and snapshots, less than a block left over
    budget = e.cfg.kv_cache_bytes or CPU_KV_BYTES
    assert 0 <= budget - plan.kv_bytes - plan.snapshot_bytes < plan.kv_block_bytes
    assert plan.device_bytes == 0 and plan.reserve_bytes == 0 and plan.spec_bytes == 0 and plan.other_bytes == 0


def test_weight_bytes_are_the_models_tensor_storages(llm):
    e = llm.engine
    tower = e.media.tower if e.media is not None else None
    assert (tower is not None) == (e.model_config.vision is not None)
    tensors = model_tensors(e.runner.model, tower)
    counted = storage_bytes(tensors)
    assert e.memory_plan.weight_bytes == counted
    if e.cfg.quantization == "gptq-int8":  # the case meant to count codes, scales and one tied table
        model = e.runner.model
        assert any(isinstance(p.weight, GPTQWeight) for p in model.layers[0].mlp.gate_up.parts)
        assert model.lm_head.weight.untyped_storage().data_ptr() == model.embed_tokens.untyped_storage().data_ptr()
        assert counted < sum(t.nbytes for t in tensors)  # the shared storages were counted once


def test_longest_context_and_the_summary(llm):
    plan = llm.engine.memory_plan
    assert plan.max_model_len == llm.engine.max_model_len
    assert plan.kv_tokens == plan.kv_blocks * plan.block_size
    assert plan.longest_context == min(plan.max_model_len, plan.kv_blocks * plan.block_size)
    per_seq = -(-plan.longest_context // plan.block_size)
    assert plan.seqs_at_longest == min(plan.gdn_slots, plan.kv_blocks // per_seq) >= 1
    assert plan.context_at_most_seqs == min(plan.max_model_len, plan.kv_blocks // plan.gdn_slots * plan.block_size)
    s = plan.summary()
    for part in (f"weights {_gib(plan.weight_bytes)}", f"KV {_gib(plan.kv_bytes)}",
                 f"({plan.kv_blocks} blocks = {plan.kv_tokens:,} tokens)", f"GDN states {_gib(plan.gdn_bytes)}",
                 f"({plan.gdn_slots} slots + 1 scratch)", f"prefix snapshots {_gib(plan.snapshot_bytes)} "
                 f"({plan.snapshots})", f"holds {plan.seqs_at_longest} sequence(s) of {plan.longest_context:,} tokens",
                 f"or {plan.gdn_slots} of {plan.context_at_most_seqs:,}"):
        assert part in s, (part, s)
    assert s.startswith("memory plan weights")  # no device share on the CPU
    assert plan.as_dict()["longest_context"] == plan.longest_context


# -- a cache smaller than max_model_len --------------------------------------------------------
BLOCKS = 62  # 992 tokens of blocks under max_model_len 4096
SEQS = 4


@pytest.fixture(scope="module")
def small(tiny_engine):
    from qv.config import ModelConfig
    from qv.engine.build import default_model_dir

    per_block = kv_bytes_per_block(ModelConfig.from_dir(default_model_dir()), 16, torch.float32)
    return tiny_engine(model=None, max_model_len=4096, max_num_seqs=SEQS, prefix_caching=False, block_size=16,
                       kv_cache_bytes=BLOCKS * per_block + per_block // 2)  # half a block more: rounded away


def _prompt(n: int, seed: int) -> dict:
    rng = random.Random(seed)
    return {"prompt_token_ids": [rng.randrange(300) for _ in range(n)]}


def test_blocks_limit_the_longest_context(small):
    plan = small.engine.memory_plan
    assert plan.kv_blocks == BLOCKS and plan.snapshots == 0
    assert plan.longest_context == BLOCKS * 16 == 992 < plan.max_model_len == 4096
    assert plan.seqs_at_longest == 1
    assert plan.context_at_most_seqs == BLOCKS // SEQS * 16 == 240  # 15 whole blocks each, not 992 // 4 = 248
    assert "holds 1 sequence(s) of 992 tokens, or 4 of 240" in plan.summary()


def test_the_longest_context_runs_and_one_token_more_does_not(small):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = small.generate(_prompt(992 - 8, 0), params)[0]
    assert len(out.outputs[0].token_ids) == 8 and out.outputs[0].finish_reason == "length"
    over = small.generate(_prompt(992, 1), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))[0]
    assert over.outputs[0].finish_reason == "error" and "whole cache holds 992 tokens" in over.error
    assert small.engine.stats.num_preemptions == 0


def test_every_slot_at_its_planned_context_runs_at_once(small, monkeypatch):
    """SEQS sequences of context_at_most_seqs tokens (prompt 160 + 80 decoded) all in one batch, no
    preemption: the plan's per-slot context fits the blocks (248 tokens each would need 64 of 62)."""
    sched = small.engine.scheduler
    batch_sizes, schedule = [], sched.schedule
    monkeypatch.setattr(sched, "schedule", lambda: (p := schedule(), batch_sizes.append(len(p.scheduled)))[0])
    ctx = small.engine.memory_plan.context_at_most_seqs
    before = small.engine.stats.num_preemptions
    outs = small.generate([_prompt(160, 10 + i) for i in range(SEQS)],
                          SamplingParams(temperature=0, max_tokens=ctx - 160, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == ctx - 160 and o.outputs[0].finish_reason == "length" for o in outs)
    assert max(batch_sizes) == SEQS
    assert small.engine.stats.num_preemptions == before
    assert small.engine.blocks.num_free == BLOCKS


def test_gpu_plan_counts_the_prefill_attention_workspace():
    """On a GPU the plan holds back the prompt chunks' cuDNN attention workspace (K/V of a 32K-key piece and
    the padded queries, fp16): at the 27B shapes with 8192-token chunks, 2 * 32768 * 4 * 256 * 2 bytes of K/V
    plus 9216 padded rows of 24 query heads."""
    from qv.bench.presets import preset_config
    from qv.config import EngineConfig, ModelConfig
    from qv.engine.build import plan_memory

    mcfg = ModelConfig.from_dict(preset_config("27b"))
    cfg = EngineConfig(max_num_batched_tokens=8192, kv_cache_bytes=1 << 30, prefix_caching=False)
    _, gpu = plan_memory(cfg, mcfg, torch.bfloat16, 32768, room=60 << 30, total=80 << 30)
    _, cpu = plan_memory(cfg, mcfg, torch.bfloat16, 32768, room=0, total=0)
    assert gpu.other_bytes - cpu.other_bytes == (2 * 32768 * 4 + 9216 * 24) * 256 * 2
