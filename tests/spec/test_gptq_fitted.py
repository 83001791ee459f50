"""Calibrated GPTQ against round-to-nearest on the fitted tiny model (a model with structure: its greedy output
walks cycles of token ids, and its MTP head is fitted to that): at the same bits, group and symmetry, GPTQ's
logit error against the dense model on held-out text must be measurably below RTN's (a GPTQ that rounded to
nearest fails). Both errors are published in docs/VALIDATION.md ("calibrated GPTQ"). The quantized folders
load in qv with their MTP head (its modules rounded to nearest)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from qv.model.batch import build_step_batch
from qv.model.cache import allocate_cache
from qv.model.quantize import GPTQOptions, quantize_checkpoint
from qv.model.qwen3_5 import load_text_model
from qv.model_config import ModelConfig
from qv.spec.mtp import load_mtp_head

HELD_OUT = Path(__file__).parents[2] / "docs" / "QUICKSTART_SERVER.md"  # text GPTQ never calibrated on
SEQS, LENGTH = 8, 96


def _logits(model_dir, seqs: list[list[int]]) -> torch.Tensor:
    model = load_text_model(str(model_dir))
    blocks = -(-LENGTH // 16)
    out = []
    for s in seqs:
        cache = allocate_cache(model.cfg, blocks, 16, 1, torch.float32, torch.float32, torch.float32, "cpu")
        batch = build_step_batch([len(s)], [len(s)], [list(range(blocks))], [0], 16)
        out.append(model.compute_logits(model.forward(torch.tensor(s), torch.arange(len(s)), batch, cache)))
    return torch.cat(out)[:, :model.cfg.vocab_size]


@pytest.fixture(scope="module")
def held_out(fitted_dir):
    ids = AutoTokenizer.from_pretrained(fitted_dir)(HELD_OUT.read_text(), add_special_tokens=False)["input_ids"]
    assert len(ids) >= SEQS * LENGTH
    seqs = [ids[i * LENGTH:(i + 1) * LENGTH] for i in range(SEQS)]
    return seqs, _logits(fitted_dir, seqs)


@pytest.mark.parametrize("bits", [8, 4])
def test_gptq_logit_error_below_rtn_on_the_fitted_model(fitted_dir, held_out, tmp_path, bits):
    seqs, dense = held_out
    errors = {}
    for method, static in (("rtn", True), ("gptq", True), ("gptq", False)):
        out = tmp_path / f"{method}-{static}"
        opts = GPTQOptions(num_samples=32, seq_len=128, device="cpu", seed=0, static_groups=static)
        quantize_checkpoint(fitted_dir, out, bits=bits, group_size=32, sym=True, method=method, gptq=opts,
                            log=lambda *_: None)
        method = method if method == "rtn" else f"gptq {'static' if static else 'dynamic'} groups"
        logits = _logits(out, seqs)
        diff = logits - dense
        errors[method] = (float(diff.pow(2).mean().sqrt() / dense.pow(2).mean().sqrt()), float(diff.abs().max()),
                          float((logits.argmax(1) == dense.argmax(1)).float().mean()))
    cfg = ModelConfig.from_dir(out)
    load_mtp_head(str(out), cfg, load_text_model(str(out), cfg), torch.float32, "cpu")
    print(f"fitted tiny model, {bits}-bit group 32 sym, {SEQS}x{LENGTH} held-out tokens: "
          + "; ".join(f"{m}: rel rms logit error {e[0]:.4f}, max {e[1]:.3f}, top-1 {e[2]:.4f}"
                      for m, e in errors.items()))
    assert errors["gptq static groups"][0] < 0.9 * errors["rtn"][0]  # measured 0.82x (8 bits), 0.81x (4)
    assert errors["gptq dynamic groups"][0] < 0.85 * errors["rtn"][0]  # measured 0.68x, 0.79x
