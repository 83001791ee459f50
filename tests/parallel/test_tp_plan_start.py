"""The dry run's plan at tensor_parallel_size 2 is the plan a real start makes (issue 35): a gloo worker
loads its shard and the driver plans from rank 0's measured weights and the rank's heads; every figure
agrees with preflight's but the weights, counted from shapes (within 1%). A 8-bit GPTQ checkpoint on a
planned 64 MiB device, so the KV blocks are what the rank's budget buys."""

from __future__ import annotations

from qv import LLM
from qv.config import EngineConfig
from qv.engine.preflight import preflight
from qv.model.quantize import quantize_checkpoint


def test_tp2_dry_run_plan_is_the_starts_plan(tiny_dirs, tmp_path):
    folder = quantize_checkpoint(tiny_dirs("gqa1"), tmp_path / "q", bits=8, group_size=16, sym=True)
    levers = dict(model=str(folder), device="cpu", tensor_parallel_size=2, device_memory_bytes=64 << 20,
                  max_num_seqs=3, prefix_caching=False)
    planned = preflight(EngineConfig(**levers), check_port=False).plan
    llm = LLM(**levers)
    try:
        real = llm.engine.memory_plan
    finally:
        llm.engine.shutdown()
    assert planned.tensor_parallel_size == real.tensor_parallel_size == 2
    assert abs(planned.weight_bytes - real.weight_bytes) <= 0.01 * real.weight_bytes
    # the KV budget is what the weights leave: within the weights' 1%, the same blocks
    assert abs(planned.kv_blocks - real.kv_blocks) <= 0.01 * real.kv_blocks
    same = ("device_bytes", "block_size", "kv_block_bytes", "gdn_slots", "gdn_slot_bytes", "snapshots", "spec_bytes",
            "other_bytes", "max_model_len")
    assert {k: getattr(planned, k) for k in same} == {k: getattr(real, k) for k in same}
