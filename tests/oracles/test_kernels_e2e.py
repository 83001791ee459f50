"""End to end on the GPU: the tiny fixtures give the same greedy tokens with the Triton kernels as
with the reference ops (fp32, bf16; bf16 also over an int8 KV cache and int16 GDN state), and
fp16 logits stay within a bound. A prefill of two prompts in one flat batch (crossing GDN chunk
and KV block boundaries), then batched greedy decode steps."""

from __future__ import annotations

import pytest
import torch

from qv import kernels as K
from qv.model.batch import build_step_batch
from qv.model.cache import allocate_cache
from qv.model.qwen3_5 import load_text_model
from util import rel_err

BS = 16
PROMPT_LENS = (70, 23)
STEPS = 12
FP16_LOGIT_BOUND = 2e-2


def greedy(model, prompts: list[list[int]], kv_dtype, state_dtype, backend: str):
    """Tokens generated per prompt and the logits of every step, [steps + 1, B, vocab]."""
    dev = model.device
    cache = allocate_cache(model.cfg, 32, BS, 5, kv_dtype, state_dtype, model.dtype, dev)
    tables = [[3, 9, 0, 12, 7, 30, 1], [21, 4, 17, 8]]  # scattered blocks
    slots = [4, 1]
    seqs = [list(p) for p in prompts]
    done = [0] * len(seqs)
    all_logits = []
    with K.backend(backend):
        for _ in range(STEPS + 1):
            qlens = [len(s) - d for s, d in zip(seqs, done)]
            batch = build_step_batch(qlens, [len(s) for s in seqs], tables, slots, BS, device=dev)
            ids = torch.tensor([t for s, d in zip(seqs, done) for t in s[d:]], device=dev)
            pos = torch.cat([torch.arange(d, len(s), device=dev) for s, d in zip(seqs, done)])
            hidden = model.forward(ids, pos, batch, cache)
            logits = model.compute_logits(hidden[batch.logits_indices])
            all_logits.append(logits)
            done = [len(s) for s in seqs]
            for s, tok in zip(seqs, logits.argmax(-1).tolist()):
                s.append(tok)
    return [s[len(p):] for s, p in zip(seqs, prompts)], torch.stack(all_logits)


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tiny", "gqa1", "gqa3", "mixed"])
@pytest.mark.parametrize("dtype,kv_dtype,state_dtype", [
    (torch.float32, torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16, torch.float32),
    (torch.bfloat16, torch.int8, torch.int16),
])
def test_greedy_tokens_match_reference(tiny_dirs, preset, dtype, kv_dtype, state_dtype):
    model = load_text_model(str(tiny_dirs(preset)), dtype=dtype, device="cuda")
    prompts = _prompts(model.cfg.vocab_size)
    ref_tokens, ref_logits = greedy(model, prompts, kv_dtype, state_dtype, "reference")
    tri_tokens, tri_logits = greedy(model, prompts, kv_dtype, state_dtype, "triton")
    print(f"{preset} {dtype}: logits rel err {rel_err(tri_logits, ref_logits):.3e}")
    assert tri_tokens == ref_tokens


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tiny", "mixed"])
def test_fp16_logits_bounded(tiny_dirs, preset):
    model = load_text_model(str(tiny_dirs(preset)), dtype=torch.float16, device="cuda")
    prompts = _prompts(model.cfg.vocab_size)
    ref_tokens, ref_logits = greedy(model, prompts, torch.float16, torch.float32, "reference")
    # teacher forcing: the Triton run consumes the reference's tokens, so logits compare step by step
    tri_logits = _forced_logits(model, prompts, ref_tokens)
    err = rel_err(tri_logits, ref_logits)
    print(f"{preset} fp16: logits rel err {err:.3e}")
    assert not torch.isnan(tri_logits).any() and err < FP16_LOGIT_BOUND


def _forced_logits(model, prompts, tokens):
    dev = model.device
    cache = allocate_cache(model.cfg, 32, BS, 5, torch.float16, torch.float32, model.dtype, dev)
    tables, slots = [[3, 9, 0, 12, 7, 30, 1], [21, 4, 17, 8]], [4, 1]
    seqs = [list(p) + list(t) for p, t in zip(prompts, tokens)]
    done = [0] * len(seqs)
    ends = [len(p) for p in prompts]
    out = []
    with K.backend("triton"):
        for _ in range(STEPS + 1):
            qlens = [e - d for e, d in zip(ends, done)]
            batch = build_step_batch(qlens, ends, tables, slots, BS, device=dev)
            ids = torch.tensor([t for s, d, e in zip(seqs, done, ends) for t in s[d:e]], device=dev)
            pos = torch.cat([torch.arange(d, e, device=dev) for d, e in zip(done, ends)])
            out.append(model.compute_logits(model.forward(ids, pos, batch, cache)[batch.logits_indices]))
            done, ends = ends, [e + 1 for e in ends]
    return torch.stack(out)
