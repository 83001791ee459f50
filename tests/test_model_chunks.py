"""Chunked and packed execution equal one call: the KV cache and the GDN conv/recurrent state
carried between steps, and the per-sequence boundaries of a packed flat batch, change nothing.

A chunk that dropped the carried state (conv tail, recurrent state, earlier KV blocks), a slot
or block mix-up between packed sequences, or a wrong position offset would change the logits far
beyond the bound. Blocks and slots are deliberately scattered (not 0, 1, 2, ...).
"""

from __future__ import annotations

import random

import pytest
import torch

from qv.model.batch import build_step_batch
from qv.model.cache import allocate_cache
from qv.model.qwen3_5 import load_text_model
from util import assert_close

BOUND = 1e-5
BS = 16  # KV block size
NUM_BLOCKS, NUM_SLOTS = 48, 6


class Runner:
    """One model, one cache, and scattered block tables / state slots per sequence."""

    def __init__(self, model, rng: random.Random):
        self.model = model
        self.cache = allocate_cache(model.cfg, NUM_BLOCKS, BS, NUM_SLOTS, torch.float32, torch.float32,
                                    torch.float32, "cpu")
        self.free_blocks = rng.sample(range(NUM_BLOCKS), NUM_BLOCKS)
        self.free_slots = rng.sample(range(NUM_SLOTS), NUM_SLOTS)
        self.seqs: dict[str, dict] = {}

    def add(self, name: str, max_len: int):
        n = (max_len + BS - 1) // BS
        blocks, self.free_blocks = self.free_blocks[:n], self.free_blocks[n:]
        self.seqs[name] = {"blocks": blocks, "slot": self.free_slots.pop(), "done": 0}

    def step(self, work: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Run the next tokens of several sequences in one flat batch; logits of every row, per sequence."""
        qlens, slens, tables, slots, pos = [], [], [], [], []
        for name, toks in work:
            s = self.seqs[name]
            qlens.append(toks.numel())
            slens.append(s["done"] + toks.numel())
            tables.append(s["blocks"])
            slots.append(s["slot"])
            pos.append(torch.arange(s["done"], s["done"] + toks.numel()))
            s["done"] += toks.numel()
        batch = build_step_batch(qlens, slens, tables, slots, BS, logits_rows=list(range(sum(qlens))))
        ids = torch.cat([t for _, t in work])
        hidden = self.model.forward(ids, torch.cat(pos), batch, self.cache)
        return list(self.model.compute_logits(hidden[batch.logits_indices]).split(qlens))


def alone(model, ids: torch.Tensor, chunk: int, rng: random.Random) -> torch.Tensor:
    r = Runner(model, rng)
    r.add("s", ids.numel())
    return torch.cat([r.step([("s", ids[i:i + chunk])])[0] for i in range(0, ids.numel(), chunk)])


@pytest.fixture(params=["tiny", "gqa1"])
def setup(request, tiny_dirs):
    seed = random.randrange(2**31)
    print(f"seed {seed}")  # shown with the failure
    rng = random.Random(seed)
    model = load_text_model(str(tiny_dirs(request.param)))
    return model, rng, torch.Generator().manual_seed(seed), request.param


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_equals_one_call(setup, chunk):
    model, rng, gen, preset = setup
    # 64-chunks: two full ones and a ragged tail over 9+ KV blocks; token-by-token: past 2 KV blocks
    # (shorter, as each step is a full forward)
    t = (35 if chunk == 1 else 130) + rng.randrange(20)
    ids = torch.randint(0, model.cfg.vocab_size, (t,), generator=gen)
    whole = alone(model, ids, t, rng)
    err = assert_close(f"{preset} chunks of {chunk} vs one call ({t} tokens)", alone(model, ids, chunk, rng), whole, BOUND)
    print(f"{preset} chunks of {chunk}: rel err {err:.2e}")


def test_packed_batch_equals_each_alone(setup):
    model, rng, gen, preset = setup
    lens = [1, 9, 33, 70]
    rng.shuffle(lens)
    seqs = {f"s{i}": torch.randint(0, model.cfg.vocab_size, (n,), generator=gen) for i, n in enumerate(lens)}
    r = Runner(model, rng)
    for name, ids in seqs.items():
        r.add(name, ids.numel())
    packed = r.step(list(seqs.items()))
    for (name, ids), got in zip(seqs.items(), packed):
        err = assert_close(f"{preset} packed {name} ({ids.numel()} tokens)", got, alone(model, ids, ids.numel(), rng), BOUND)
        print(f"{preset} packed, {ids.numel()} tokens: rel err {err:.2e}")


def test_mixed_step_with_carried_state(setup):
    """One step holding a continuing prefill chunk, a decode row and a fresh sequence together."""
    model, rng, gen, preset = setup
    a, b, c = (torch.randint(0, model.cfg.vocab_size, (n,), generator=gen) for n in (40, 21, 25))
    r = Runner(model, rng)
    for name, ids in (("a", a), ("b", b), ("c", c)):
        r.add(name, ids.numel())
    r.step([("a", a[:23]), ("b", b[:20])])  # earlier step: both start from zero state
    got_a, got_b, got_c = r.step([("a", a[23:]), ("b", b[20:]), ("c", c)])
    assert_close(f"{preset} continuing chunk", got_a, alone(model, a, a.numel(), rng)[23:], BOUND)
    assert_close(f"{preset} decode row", got_b, alone(model, b, b.numel(), rng)[20:], BOUND)
    assert_close(f"{preset} fresh sequence", got_c, alone(model, c, c.numel(), rng), BOUND)
