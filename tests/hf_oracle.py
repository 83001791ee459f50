"""The transformers oracle shared by the model tests: qv's logits (fp32) against transformers'
Qwen3_5ForCausalLM / Qwen3_5ForConditionalGeneration (float64) on a checkpoint folder.

The bound is BOUND (1e-5 relative). Some inputs are ill-conditioned in fp32 whoever computes
them: when a Gated DeltaNet head's output nearly cancels, the gated RMSNorm after it rescales
that head to unit size and with it the rounding noise (measured on the tiny `mixed` preset,
linear_key_head_dim 8: transformers' own fp32 run misses 1e-5 on ~7% of random prompts). Only
there, qv must stay within NOISE_FACTOR of the fp32 noise of that very input, measured without
qv: transformers' fp32 run and two float64 runs with every weight perturbed by a random relative
2^-24 (half an fp32 ulp). A real defect (a wrong rotary, norm, gate, state hand-over, zero
offset) errs by 1e-3 or more, far above either limit.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from qv.model.batch import build_step_batch
from qv.model.cache import allocate_cache
from qv.model.qwen3_5 import load_text_model
from util import rel_err

BOUND = 1e-5
NOISE_FACTOR = 4.0
CEILING = 1e-4  # never more than this, however ill-conditioned


def qv_logits(model_dir, ids: torch.Tensor) -> torch.Tensor:
    """qv's logits [T, vocab] for every position of one sequence, in one step, fp32."""
    model = load_text_model(str(model_dir))
    t, bs = ids.numel(), 16
    blocks = list(range((t + bs - 1) // bs))
    batch = build_step_batch([t], [t], [blocks], [0], bs, logits_rows=list(range(t)))
    cache = allocate_cache(model.cfg, len(blocks), bs, 1, torch.float32, torch.float32, torch.float32, "cpu")
    hidden = model.forward(ids, torch.arange(t), batch, cache)
    return model.compute_logits(hidden[batch.logits_indices])


def hf_model(model_dir: Path, dtype: torch.dtype):
    """transformers' model for the folder's architecture; asserts the folder is a complete checkpoint."""
    import transformers

    arch = json.loads((Path(model_dir) / "config.json").read_text())["architectures"][0]
    model, info = getattr(transformers, arch).from_pretrained(str(model_dir), dtype=dtype, output_loading_info=True)
    # A missing key would be randomly initialised by transformers and compared against qv's real
    # tensor; an unexpected one means the folder holds something the architecture does not have.
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model


@torch.no_grad()
def fp32_noise(model_dir: Path, ids: torch.Tensor, ref: torch.Tensor, hf64) -> float:
    """How far fp32-sized rounding alone moves this input's logits (see the module docstring)."""
    errs = [rel_err(hf_model(model_dir, torch.float32)(input_ids=ids[None]).logits[0], ref)]
    for seed in (1, 2):
        gen, model = torch.Generator().manual_seed(seed), copy.deepcopy(hf64)
        for p in model.parameters():
            p.mul_(1 + 2.0**-24 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
        errs.append(rel_err(model(input_ids=ids[None]).logits[0], ref))
    return max(errs)


@torch.no_grad()
def assert_matches_hf(qv_dir: Path, hf_dir: Path, ids: torch.Tensor, label: str) -> tuple[float, float | None]:
    """qv on `qv_dir` vs transformers float64 on `hf_dir` (the same weights); returns (error, fp32
    noise or None when the plain bound held). `label` should carry the seed for a failure report."""
    ours = qv_logits(qv_dir, ids)
    hf64 = hf_model(hf_dir, torch.float64)
    ref = hf64(input_ids=ids[None]).logits[0]
    assert ours.shape == ref.shape and not torch.isnan(ours).any(), label
    err = rel_err(ours, ref)
    if err < BOUND:
        return err, None
    noise = fp32_noise(hf_dir, ids, ref, hf64)
    limit = min(CEILING, NOISE_FACTOR * noise)
    assert err < limit, (f"{label}: relative error {err:.3e} >= {BOUND:.0e}, and >= {limit:.3e} "
                         f"({NOISE_FACTOR:g}x this input's fp32 noise {noise:.3e})")
    return err, noise
