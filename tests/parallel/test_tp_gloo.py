"""Tensor parallelism at the model level, on the CPU: two processes over torch.distributed's gloo
backend each load their shard of a tiny model and run the same steps (packed prefill chunks, then
decode rows, through scattered KV blocks and GDN state slots); their logits equal the unsharded
model's within the fp32 bound. A head block sent to the wrong rank, a q/k/v or gate/up piece split
as one, a GDN conv or A_log not cut with its heads, a missing or doubled all-reduce (or bias), a
wrong vocabulary offset, a GPTQ group renumbered wrongly or an FP8 scale block taken for the wrong rows
changes the logits far beyond it.
"""

from __future__ import annotations

import dataclasses
import random
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from qv.config import ConfigError, ModelConfig
from qv.kernels.linear import GPTQWeight, linear
from qv.model.batch import build_step_batch
from qv.model.cache import allocate_cache
from qv.model.parallel import (TPGroup, VocabParallelLMHead, column_shard, rank_config, row_shard,
                               vocab_parallel_embed, vocab_shard)
from qv.model.lm_head_int8 import lm_head_int8, quantize_rows_int8
from qv.model.qwen3_5 import load_text_model
from qv.model.quantize import GPTQOptions, quantize_checkpoint
from qv.model.random_weights import GPTQ_INT8, RANDOM_QUANT, RandomReader
from qv.model.tiny import build_config
from qv.model.tiny_tokenizer import tokenizer_json
from fp8_checkpoint import write_fp8
from util import assert_close

BOUND = 1e-5
# mixed-gptq's worst step over 50 draws: median 2.7e-6, 95th percentile 1.0e-5, max 1.39e-5 (its 6 layers of
# GPTQ row-parallel sums in another order; 1e-5 failed one CI draw); the other cases stayed under 4.3e-6 over 45
CASE_BOUND = {"mixed-gptq": 5e-5, "mixed-gptq-calibrated": 5e-5}
WORLD = 2
BS, NUM_BLOCKS, NUM_SLOTS = 8, 24, 5
PROMPT_LENS, CHUNK, DECODE_STEPS = (23, 9, 40), 16, 3
VOCAB, HIDDEN, ROWS = 37, 8, 6  # vocab-parallel case: an odd vocabulary gives uneven slices (19 / 18)


# ---------------------------------------------------------------------------------------------
# what both worlds run
# ---------------------------------------------------------------------------------------------


def steps(model, seed: int) -> list[torch.Tensor]:
    """Logits of every row of each step: all prompts prefilled in packed chunks of CHUNK, then
    DECODE_STEPS decode rows per sequence (fixed random tokens, so both worlds feed the same ids)."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    cache = allocate_cache(model.cfg, NUM_BLOCKS, BS, NUM_SLOTS, torch.float32, torch.float32, torch.float32, "cpu")
    blocks, slots = rng.sample(range(NUM_BLOCKS), NUM_BLOCKS), rng.sample(range(NUM_SLOTS), len(PROMPT_LENS))
    seqs = []
    for n, slot in zip(PROMPT_LENS, slots):
        need = -(-(n + DECODE_STEPS) // BS)
        ids = torch.randint(0, model.cfg.vocab_size, (n + DECODE_STEPS,), generator=gen)
        seqs.append({"ids": ids, "prompt": n, "done": 0, "blocks": blocks[:need], "slot": slot})
        blocks = blocks[need:]
    out = []
    while any(s["done"] < s["prompt"] for s in seqs):
        chunks = [(s, min(CHUNK, s["prompt"] - s["done"])) for s in seqs if s["done"] < s["prompt"]]
        out.append(step(model, cache, chunks))
    for _ in range(DECODE_STEPS):
        out.append(step(model, cache, [(s, 1) for s in seqs]))
    return out


def step(model, cache, work: list[tuple[dict, int]]) -> torch.Tensor:
    """One flat batch of the next `take` tokens of each sequence; logits of every row."""
    qlens = [t for _, t in work]
    batch = build_step_batch(qlens, [s["done"] + t for s, t in work], [s["blocks"] for s, _ in work],
                             [s["slot"] for s, _ in work], BS, logits_rows=list(range(sum(qlens))))
    ids = torch.cat([s["ids"][s["done"]:s["done"] + t] for s, t in work])
    pos = torch.cat([torch.arange(s["done"], s["done"] + t) for s, t in work])
    hidden = model.forward(ids, pos, batch, cache)
    for s, t in work:
        s["done"] += t
    return model.compute_logits(hidden[batch.logits_indices])


def vocab_inputs():
    gen = torch.Generator().manual_seed(7)
    table = torch.randn(VOCAB, HIDDEN, generator=gen)
    ids = torch.tensor([0, 18, 19, 36, 20, 1] + torch.randint(0, VOCAB, (10,), generator=gen).tolist())
    x = torch.randn(ROWS, HIDDEN, generator=gen)
    group = 4
    codes = torch.randint(0, 256, (HIDDEN, VOCAB), generator=gen, dtype=torch.uint8)
    scales = torch.rand(HIDDEN // group, VOCAB, generator=gen) * 0.01 + 0.005
    gptq = GPTQWeight(codes, scales, None, torch.arange(HIDDEN, dtype=torch.int32) // group, group)
    return table, ids, x, gptq


def vocab_parallel(tp: TPGroup) -> dict[str, torch.Tensor]:
    table, ids, x, gptq = vocab_inputs()
    start = tp.rank * -(-VOCAB // tp.world_size)
    return {"embed": vocab_parallel_embed(vocab_shard(table, tp), ids, start, tp),
            "dense_head": VocabParallelLMHead(vocab_shard(table, tp), VOCAB, tp)(x),
            "gptq_head": VocabParallelLMHead(vocab_shard(gptq, tp), VOCAB, tp)(x),
            "int8_head": lm_head_int8(VocabParallelLMHead(vocab_shard(table, tp), VOCAB, tp))(x)}


def load(spec: dict, tp: TPGroup | None):
    if "random" in spec:
        return load_text_model("", spec["random"], reader=RandomReader(spec["random"], seed=3), tp=tp)
    return load_text_model(spec["dir"], tp=tp)


def worker(rank: int, init: str, cases: dict, out_dir: str) -> None:
    torch.set_num_threads(1)  # two processes on a small machine
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD, timeout=timedelta(seconds=120))
    try:
        tp = TPGroup.from_distributed()
        results = {name: steps(load(spec, tp), spec["seed"]) for name, spec in cases.items()}
        results["vocab"] = vocab_parallel(tp)
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# the cases
# ---------------------------------------------------------------------------------------------


def random_untied_cfg(quant=GPTQ_INT8) -> ModelConfig:
    """gqa3's geometry with GDN heads 2/4 (gqa3's single key head does not split), untied, GPTQ-Int8
    (group 8) from random weights: the untied lm_head, the RandomReader's codes cut as a checkpoint's.
    With AWQ's settings: 4-bit codes two a byte along K, zero points, row shards on packed rows."""
    _, special = tokenizer_json()
    raw = build_config("gqa3", 384, special)
    raw.update(linear_num_key_heads=2, linear_num_value_heads=4)
    cfg = ModelConfig.from_dict(raw)
    assert not cfg.tie_word_embeddings
    return dataclasses.replace(cfg, quant=dataclasses.replace(quant, group_size=8))


@pytest.fixture(scope="module")
def cases(tiny_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    seed = random.randrange(2**31)
    print(f"seed {seed}")  # shown with a failure
    return {
        # tied, GQA 1, GDN ratio 1, dense
        "gqa1": {"dir": str(tiny_dirs("gqa1")), "seed": seed},
        # tied, GQA 2, GDN ratio 2, GPTQ-Int8 group 8 (rank shards of o_proj/out_proj/down hold 4/5/9 groups)
        # beside dense in_proj_b/a
        "mixed-gptq": {"dir": str(quantize_checkpoint(tiny_dirs("mixed"), root / "mixed-gptq", group_size=8)),
                       "seed": seed + 1},
        # calibrated GPTQ (act order, static groups: g_idx k // 8, so row shards hold whole groups)
        "mixed-gptq-calibrated": {"dir": str(quantize_checkpoint(
            tiny_dirs("mixed"), root / "mixed-gptq-calibrated", group_size=8, method="gptq",
            gptq=GPTQOptions(num_samples=4, seq_len=32, device="cpu"), log=lambda *_: None)), "seed": seed + 4},
        "random-untied-gptq": {"random": random_untied_cfg(), "seed": seed + 2},
        "random-untied-awq": {"random": random_untied_cfg(RANDOM_QUANT["awq"]), "seed": seed + 3},
        # block FP8 in Qwen's layout, 8x8 blocks: column shards take their scale rows, row shards scale columns
        "mixed-fp8": {"dir": str(write_fp8(tiny_dirs("mixed"), root / "mixed-fp8", (8, 8))), "seed": seed + 5},
    }


@pytest.fixture(scope="module")
def two_ranks(cases, tmp_path_factory):
    """Each rank's results of the cases (run once for the module: spawning costs more than the steps)."""
    out = tmp_path_factory.mktemp("tp-out")
    mp.spawn(worker, args=(f"file://{out}/rendezvous", cases, str(out)), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


@pytest.mark.parametrize("name", ["gqa1", "mixed-gptq", "mixed-gptq-calibrated", "random-untied-gptq",
                                  "random-untied-awq", "mixed-fp8"])
def test_tp2_logits_equal_tp1(name, cases, two_ranks):
    ref = steps(load(cases[name], None), cases[name]["seed"])
    assert len(ref) > DECODE_STEPS  # chunked prefill steps, then the decode steps
    for rank, results in enumerate(two_ranks):
        assert len(results[name]) == len(ref)
        errs = [assert_close(f"{name} rank {rank} step {i}", got, want, CASE_BOUND.get(name, BOUND))
                for i, (got, want) in enumerate(zip(results[name], ref))]
        print(f"{name} rank {rank}: max rel err over {len(errs)} steps {max(errs):.2e}")


def test_vocab_parallel_embedding_and_lm_head(two_ranks):
    table, ids, x, gptq = vocab_inputs()
    want = {"embed": table[ids], "dense_head": x @ table.t(), "gptq_head": linear(x, gptq),
            "int8_head": linear(x, quantize_rows_int8(table))}  # per-row scales: each rank's rows quantize alike
    for rank, results in enumerate(two_ranks):
        for key, ref in want.items():
            assert_close(f"vocab-parallel {key} rank {rank}", results["vocab"][key], ref, BOUND)


# ---------------------------------------------------------------------------------------------
# shard rules that need no second process
# ---------------------------------------------------------------------------------------------


def test_gptq_split_that_cuts_a_group_is_refused(tiny_dirs, tmp_path):
    # gqa1's GDN out_proj has 32 inputs: one group of 32, which two ranks of 16 rows would cut
    quant = quantize_checkpoint(tiny_dirs("gqa1"), tmp_path / "g32", group_size=32)
    with pytest.raises(ConfigError, match=r"layers\.1\.linear_attn\.out_proj.*cut GPTQ groups"):
        load_text_model(str(quant), tp=TPGroup(rank=1, world_size=2))


def test_fp8_split_that_cuts_a_scale_block_is_refused(tiny_dirs, tmp_path):
    # gqa1's GDN q, k and v pieces are 32 channels each: rank 1's 16-row blocks start inside a 32-row scale block
    fp8 = write_fp8(tiny_dirs("gqa1"), tmp_path / "fp8", (32, 32))
    with pytest.raises(ConfigError, match=r"in_proj_qkv.*at row 16, inside a 32-wide scale block"):
        load_text_model(str(fp8), tp=TPGroup(rank=1, world_size=2))


def test_head_counts_that_do_not_split_are_refused(tiny_dirs):
    cfg = ModelConfig.from_dir(tiny_dirs("tiny"))  # one KV head
    with pytest.raises(ConfigError, match="does not divide num_key_value_heads=1"):
        rank_config(cfg, 2)


def test_gptq_shards_sum_to_the_whole_under_act_order():
    """Row shards of a weight whose g_idx is permuted (desc_act), each group within one rank's rows,
    sum to the whole product; column shards concatenate to it. Fresh random codes and scales."""
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    k, n, group = 24, 12, 4
    g_idx = torch.cat([torch.randperm(k // 2, generator=gen) // group,
                       torch.randperm(k // 2, generator=gen) // group + k // 2 // group]).to(torch.int32)
    w = GPTQWeight(torch.randint(0, 256, (k, n), generator=gen, dtype=torch.uint8),
                   torch.rand(k // group, n, generator=gen) * 0.01 + 0.005,
                   torch.randint(120, 137, (k // group, n), generator=gen).float(), g_idx, group)
    x = torch.randn(5, k, generator=gen)
    whole = linear(x, w)
    ranks = [TPGroup(r, 2) for r in range(2)]
    rows = sum(linear(x[:, r.rank * k // 2:(r.rank + 1) * k // 2], row_shard(w, r, "w"))
               for r in ranks)
    assert_close("row shards summed", rows, whole, BOUND)
    cols = torch.cat([linear(x, column_shard(w, [n // 2, n // 2], r, "w")) for r in ranks], -1)
    halves = [slice(0, n // 4), slice(n // 2, 3 * n // 4), slice(n // 4, n // 2), slice(3 * n // 4, n)]
    assert_close("column shards of two pieces", cols, torch.cat([whole[:, s] for s in halves], -1), BOUND)
    w.g_idx[0], w.g_idx[-1] = w.g_idx[-1].clone(), w.g_idx[0].clone()  # a group now spans both ranks
    with pytest.raises(ConfigError, match="cut GPTQ groups"):
        row_shard(w, ranks[0], "w")


def test_int4_shards_sum_to_the_whole_under_act_order():
    """4-bit: a row shard takes the packed byte rows of its inputs (two a byte); with act-order g_idx and
    zero points the shards still sum to the whole, column shards concatenate; a split inside a byte fails."""
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    k, n, group = 24, 12, 4
    g_idx = torch.cat([torch.randperm(k // 2, generator=gen) // group,
                       torch.randperm(k // 2, generator=gen) // group + k // 2 // group]).to(torch.int32)
    w = GPTQWeight(torch.randint(0, 256, (k // 2, n), generator=gen, dtype=torch.uint8),
                   torch.rand(k // group, n, generator=gen) * 0.1 + 0.05,
                   torch.randint(0, 16, (k // group, n), generator=gen).float(), g_idx, group, bits=4)
    x = torch.randn(5, k, generator=gen)
    whole = linear(x, w)
    ranks = [TPGroup(r, 2) for r in range(2)]
    shards = [row_shard(w, r, "w") for r in ranks]
    assert all((s.bits, s.in_features, s.qweight.shape[0]) == (4, k // 2, k // 4) for s in shards)
    rows = sum(linear(x[:, r.rank * k // 2:(r.rank + 1) * k // 2], s) for r, s in zip(ranks, shards))
    assert_close("4-bit row shards summed", rows, whole, BOUND)
    cols = torch.cat([linear(x, column_shard(w, [n], r, "w")) for r in ranks], -1)
    assert_close("4-bit column shards", cols, whole, BOUND)
    odd = GPTQWeight(w.qweight[:7], w.scales[:2], None, torch.arange(14, dtype=torch.int32) // 7, 7, bits=4)
    with pytest.raises(ConfigError, match="inside a byte"):  # 14 inputs, groups of 7: rank 0 would end at row 7
        row_shard(odd, ranks[0], "w")
