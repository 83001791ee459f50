"""End to end on the GPU: the tiny fixtures generate the same greedy tokens with the Triton kernels
as with the reference ops. A prefill of two prompts in one flat batch (crossing GDN chunk and KV
block boundaries over scattered blocks and slots), then batched greedy decode steps. Also 4-bit (`qv quantize
--bits 4`) tiny models in fp32 through the W4A16 kernels.

fp32: both backends run free and must produce identical tokens. 16-bit: the logits are bf16/fp16
values, and the tiny random models often have exact ties at that resolution, which either side's
rounding may break; so the Triton run is teacher-forced on the reference's tokens and must pick
the reference's token at every step whose top-2 gap exceeds two ulps of the logit dtype, with
the logit error bounded (bf16 also over an int8 KV cache and int16 GDN state)."""

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
TABLES, SLOTS = [[3, 9, 0, 12, 7, 30, 1], [21, 4, 17, 8]], [4, 1]  # scattered blocks and state slots
LOGIT_BOUND = {torch.bfloat16: 5e-2, torch.float16: 2e-2}


def run(model, prompts, kv_dtype, state_dtype, backend, forced=None):
    """Greedy generation (or teacher forcing on `forced` tokens): tokens per prompt and the logits
    of every step [STEPS + 1, B, vocab]."""
    dev = model.device
    cache = allocate_cache(model.cfg, 32, BS, 5, kv_dtype, state_dtype, model.dtype, dev)
    seqs = [list(p) for p in prompts]
    done = [0] * len(seqs)
    steps = []
    with K.backend(backend):
        for step in range(STEPS + 1):
            qlens = [len(s) - d for s, d in zip(seqs, done)]
            batch = build_step_batch(qlens, [len(s) for s in seqs], TABLES, SLOTS, BS, device=dev)
            ids = torch.tensor([t for s, d in zip(seqs, done) for t in s[d:]], device=dev)
            pos = torch.cat([torch.arange(d, len(s), device=dev) for s, d in zip(seqs, done)])
            logits = model.compute_logits(model.forward(ids, pos, batch, cache)[batch.logits_indices])
            steps.append(logits)
            done = [len(s) for s in seqs]
            nxt = logits.argmax(-1).tolist() if forced is None else [f[step] for f in forced]
            for s, tok in zip(seqs, nxt):
                s.append(tok)
    return [s[len(p):] for s, p in zip(seqs, prompts)], torch.stack(steps)


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tiny", "gqa1", "gqa3", "mixed"])
def test_fp32_greedy_tokens_match(tiny_dirs, preset):
    model = load_text_model(str(tiny_dirs(preset)), dtype=torch.float32, device="cuda")
    prompts = _prompts(model.cfg.vocab_size)
    ref_tokens, ref_logits = run(model, prompts, torch.float32, torch.float32, "reference")
    tri_tokens, tri_logits = run(model, prompts, torch.float32, torch.float32, "triton")
    print(f"{preset} fp32: logits rel err {rel_err(tri_logits, ref_logits):.3e}")
    assert tri_tokens == ref_tokens


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tiny", "gqa1", "gqa3", "mixed"])
@pytest.mark.parametrize("dtype,kv_dtype,state_dtype", [
    (torch.bfloat16, torch.bfloat16, torch.float32),
    (torch.bfloat16, torch.int8, torch.int16),
    (torch.float16, torch.float16, torch.float32),
])
def test_16bit_greedy_tokens_match(tiny_dirs, preset, dtype, kv_dtype, state_dtype):
    model = load_text_model(str(tiny_dirs(preset)), dtype=dtype, device="cuda")
    prompts = _prompts(model.cfg.vocab_size)
    ref_tokens, ref_logits = run(model, prompts, kv_dtype, state_dtype, "reference")
    _, tri_logits = run(model, prompts, kv_dtype, state_dtype, "triton", forced=ref_tokens)
    err = rel_err(tri_logits, ref_logits)
    top2 = ref_logits.topk(2, dim=-1).values  # [steps, B, 2]
    ulp = torch.finfo(dtype).eps * top2[..., 0].abs().clamp_min(1.0)
    decided = (top2[..., 0] - top2[..., 1]) > 2 * ulp
    agree = tri_logits.argmax(-1) == ref_logits.argmax(-1)
    print(f"{preset} {dtype} kv {kv_dtype} state {state_dtype}: logits rel err {err:.3e}, "
          f"{int((~decided).sum())} tied steps of {decided.numel()}")
    assert not torch.isnan(tri_logits).any() and err < LOGIT_BOUND[dtype]
    assert bool(agree[decided].all()), f"different greedy token at {(decided & ~agree).nonzero().tolist()}"
    assert int(decided.sum()) >= decided.numel() // 2, "too many ties for the test to mean anything"


@pytest.mark.gpu
@pytest.mark.parametrize("preset,flags", [("gqa3", dict(group_size=16, sym=False)), ("tiny", dict(group_size=32))])
def test_4bit_tiny_greedy_triton_equals_reference_gpu(tiny_dirs, tmp_path, preset, flags):
    """fp32 on the GPU: the W4A16 Triton kernels (GEMV, GEMM, split-K at the tiny shapes) through the whole
    model generate the reference ops' greedy tokens."""
    from qv.model.quantize import quantize_checkpoint

    q = quantize_checkpoint(tiny_dirs(preset), tmp_path / "q4", bits=4, **flags)
    model = load_text_model(str(q), dtype=torch.float32, device="cuda")
    prompts = _prompts(model.cfg.vocab_size)
    ref_tokens, _ = run(model, prompts, torch.float32, torch.float32, "reference")
    tri_tokens, _ = run(model, prompts, torch.float32, torch.float32, "triton")
    assert tri_tokens == ref_tokens
