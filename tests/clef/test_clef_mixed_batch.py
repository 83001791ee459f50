"""The mixed-batch property at model level (layout (b): LoRA + deabl deltas on Clef rows only):
4 Clef records and 4 chats in the same flat batches, over two steps (prefill chunks, then the
records' second chunks beside the chats' next tokens). Each chat's logits equal those of the
chats run without any Clef row; each record's head state equals the record run alone."""

from __future__ import annotations

import random

import torch

from clef_records import make_record
from qv.clef.request import encode_request
from qv.model.batch import build_step_batch
from qv.model.cache import allocate_cache
from util import rel_err

BS, NUM_BLOCKS, NUM_SLOTS = 16, 320, 8
# Not bitwise on CPU: a GEMM's summation order depends on how many rows it has. A delta leaking into
# a chat row, or a Clef row missing one, moves logits by ~1e-1 relative; rounding stays ~1e-7.
BOUND = 1e-5


class Runner:
    """A model, its cache, and scattered blocks / state slots for named sequences."""

    def __init__(self, model, seed: int):
        rng = random.Random(seed)
        self.model = model
        self.cache = allocate_cache(model.cfg, NUM_BLOCKS, BS, NUM_SLOTS, torch.float32, torch.float32, torch.float32,
                                    "cpu")
        self.free_blocks = rng.sample(range(NUM_BLOCKS), NUM_BLOCKS)
        self.free_slots = rng.sample(range(NUM_SLOTS), NUM_SLOTS)
        self.seqs: dict[str, dict] = {}

    def add(self, name: str, max_len: int) -> None:
        n = (max_len + BS - 1) // BS
        blocks, self.free_blocks = self.free_blocks[:n], self.free_blocks[n:]
        self.seqs[name] = {"blocks": blocks, "slot": self.free_slots.pop(), "done": 0}

    def step(self, work: list[tuple[str, torch.Tensor, bool]]) -> list[torch.Tensor]:
        """One flat batch; (name, new token ids, is Clef row) per sequence; final hidden rows per sequence."""
        qlens, slens, tables, slots, pos, delta_rows = [], [], [], [], [], []
        row = 0
        for name, ids, clef in work:
            s = self.seqs[name]
            qlens.append(ids.numel())
            slens.append(s["done"] + ids.numel())
            tables.append(s["blocks"])
            slots.append(s["slot"])
            pos.append(torch.arange(s["done"], s["done"] + ids.numel()))
            if clef:
                delta_rows += range(row, row + ids.numel())
            row += ids.numel()
            s["done"] += ids.numel()
        batch = build_step_batch(qlens, slens, tables, slots, BS, logits_rows=[], delta_rows=delta_rows)
        hidden = self.model.forward(torch.cat([w[1] for w in work]), torch.cat(pos), batch, self.cache)
        return list(hidden.split(qlens))


def test_mixed_batch_chats_untouched_clef_unchanged(qv_clef, tokenizers):
    model, assets = qv_clef["adapters"]
    gen = torch.Generator().manual_seed(11)
    records = [encode_request(tokenizers["adapters"], make_record(500 + i, small=True), 34816) for i in range(4)]
    vocab = model.cfg.vocab_size
    chats = [(torch.randint(0, vocab, (int(n),), generator=gen), torch.randint(0, vocab, (3,), generator=gen))
             for n in torch.randint(5, 60, (4,), generator=gen)]

    def clef_work(step: int, deltas: bool):
        work = []
        for i, rec in enumerate(records):
            half = rec.num_tokens // 2
            ids = torch.tensor(rec.input_ids[:half] if step == 0 else rec.input_ids[half:])
            work.append((f"r{i}", ids, deltas))
        return work

    def run(with_chats: bool, with_clef: list[int], deltas: bool = True):
        runner = Runner(model, seed=len(with_clef) + 10 * with_chats)
        states = {i: assets.head.state(records[i], model.lm_head.weight) for i in with_clef}
        for i in with_clef:
            runner.add(f"r{i}", records[i].num_tokens)
        for j in range(len(chats) if with_chats else 0):
            runner.add(f"c{j}", 80)
        chat_out = []
        for step in range(2):
            work = [w for w in clef_work(step, deltas) if int(w[0][1:]) in with_clef]
            chat_work = [(f"c{j}", chats[j][step], False) for j in range(len(chats) if with_chats else 0)]
            mixed = work[:2] + chat_work[:2] + work[2:] + chat_work[2:]  # interleave the two kinds
            out = dict(zip([w[0] for w in mixed], runner.step(mixed)))
            for i in with_clef:
                states[i].add_chunk(out[f"r{i}"], 0 if step == 0 else records[i].num_tokens // 2)
            chat_out.append([model.compute_logits(out[f"c{j}"]) for j in range(len(chat_work))])
        return chat_out, {i: s.logits() for i, s in states.items()}

    chats_alone, _ = run(True, [])
    mixed_chats, mixed_clef = run(True, [0, 1, 2, 3])
    worst_chat = max(rel_err(mixed_chats[step][j], chats_alone[step][j]) for step in range(2) for j in range(4))
    worst_clef = max(rel_err(mixed_clef[i], run(False, [i])[1][i]) for i in range(4))
    print(f"\nmixed batch: chat logits rel err {worst_chat:.1e}, Clef logits rel err {worst_clef:.1e}")
    assert worst_chat <= BOUND and worst_clef <= BOUND

    # the Clef rows of that batch really ran Clef's weights: without the deltas record 0 differs
    _, plain = run(False, [0], deltas=False)
    assert (plain[0] - mixed_clef[0]).abs().max() > 1e-3
