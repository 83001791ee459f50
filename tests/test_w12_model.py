"""W12 attention projections on the tiny models (CPU): what gets packed (bf16/fp16 q/k/v only), the logit error
against the same bf16 model, the pack cache (written once, hit on the next start, a pack of another model,
shape or rank rejected and packed again), and the lever through the engine."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from qv.kernels.linear import GPTQWeight, W12Weight
from qv.kernels.linear.reference import dequantize_w12
from qv.llm import LLM, SamplingParams
from qv.model.batch import build_step_batch
from qv.model.cache import allocate_cache
from qv.model.qwen3_5 import load_text_model
from qv.model.quantize import quantize_checkpoint
from qv.model.w12 import PackCache, apply_w12, model_key
from util import rel_err

# the tiny model's q/k/v packed against its bf16 logits on a 40-token prompt: measured 3.4e-3 (docs/VALIDATION.md)
LOGIT_BOUND = 1e-2


def _logits(model, ids):
    t = ids.numel()
    batch = build_step_batch([t], [t], [[0, 1, 2]], [0], 16, logits_rows=list(range(t)))
    cache = allocate_cache(model.cfg, 3, 16, 1, torch.float32, torch.float32, model.dtype, "cpu")
    return model.compute_logits(model.forward(ids, torch.arange(t), batch, cache)[batch.logits_indices])


def _qkv_weights(model):
    return [p.weight for layer in model.layers if layer.kind == "full_attention" for p in layer.mixer.qkv.parts]


def test_w12_packs_bf16_projections_and_keeps_the_logits(tiny_dirs):
    folder = tiny_dirs("tiny")
    dense = load_text_model(str(folder), dtype=torch.bfloat16)
    packed = load_text_model(str(folder), dtype=torch.bfloat16)
    assert apply_w12(packed.layers, PackCache(None, "k")) == 1  # tiny: one attention layer, q/k/v fused
    [w] = _qkv_weights(packed)
    [d] = _qkv_weights(dense)
    assert isinstance(w, W12Weight) and w.lo.numel() + w.hi.numel() == d.numel() * 3 // 2
    rep = rel_err(dequantize_w12(w), d.float())
    ids = torch.randint(0, packed.cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(3))
    err = rel_err(_logits(packed, ids), _logits(dense, ids))
    print(f"tiny W12: representation error {rep:.2e}, logits vs bf16 {err:.2e}")
    assert rep < 1e-3 and 0 < err < LOGIT_BOUND


def test_w12_leaves_fp32_and_quantized_weights(tiny_dirs, tmp_path):
    assert apply_w12(load_text_model(str(tiny_dirs("tiny"))).layers, PackCache(None, "k")) == 0  # fp32: nothing to gain
    gptq = load_text_model(str(quantize_checkpoint(tiny_dirs("tiny"), tmp_path / "q", group_size=32)),
                           dtype=torch.bfloat16)
    assert apply_w12(gptq.layers, PackCache(None, "k")) == 0
    assert all(isinstance(w, GPTQWeight) for w in _qkv_weights(gptq))


def test_w12_cache_hit_and_rejection(tiny_dirs, tmp_path):
    folder = tiny_dirs("gqa1")  # two attention layers (q/k/v fused in each)
    key = model_key(folder, "auto", 0)
    first = PackCache(tmp_path, key, rank=1, world=2)
    model = load_text_model(str(folder), dtype=torch.bfloat16)
    assert apply_w12(model.layers, first) == 2 and first.hits == 0
    files = sorted((tmp_path / "w12" / key).iterdir())
    assert len(files) == 2 and all(f.name.endswith(".qkv.0.tp2r1.safetensors") for f in files)
    again = PackCache(tmp_path, key, rank=1, world=2)
    model2 = load_text_model(str(folder), dtype=torch.bfloat16)
    assert apply_w12(model2.layers, again) == 2 and (again.hits, again.rejected) == (2, 0)
    for a, b in zip(_qkv_weights(model), _qkv_weights(model2)):
        assert torch.equal(a.lo, b.lo) and torch.equal(a.hi, b.hi) and torch.equal(a.scale, b.scale)
    # another rank's pack under this rank's name, and a pack of other weights: rejected, packed again
    with safe_open(str(files[0]), framework="pt") as f:
        meta, tensors = f.metadata(), {t: f.get_tensor(t) for t in f.keys()}
    save_file(tensors, str(files[0]), metadata=dict(meta, rank="0"))
    with safe_open(str(files[1]), framework="pt") as f:
        meta, tensors = f.metadata(), {t: f.get_tensor(t) for t in f.keys()}
    save_file({"lo": tensors["lo"] ^ 1, "hi": tensors["hi"], "scale": tensors["scale"]}, str(files[1]),
              metadata=dict(meta, fingerprint="0" * 32))
    third = PackCache(tmp_path, key, rank=1, world=2)
    model3 = load_text_model(str(folder), dtype=torch.bfloat16)
    assert apply_w12(model3.layers, third) == 2 and (third.hits, third.rejected) == (0, 2)
    for a, b in zip(_qkv_weights(model), _qkv_weights(model3)):
        assert torch.equal(a.lo, b.lo)
    assert model_key(folder, "random", 1) != model_key(folder, "random", 2) != key


@pytest.mark.parametrize("w12", [True, False])
def test_w12_lever_through_the_engine(tiny_dirs, w12):
    """The target's projections and the MTP head's packed (or not), and speculation runs on them."""
    llm = LLM(model=str(tiny_dirs("tiny", mtp=True)), dtype="bfloat16", w12=w12, spec="mtp", spec_k=2)
    [w] = _qkv_weights(llm.engine.runner.model)
    [head_w] = [p.weight for p in llm.engine.spec.head.layer.mixer.qkv.parts]
    assert isinstance(w, W12Weight) == w12 and isinstance(head_w, W12Weight) == w12
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert len(llm.generate(["hello there"], params)[0].outputs[0].token_ids) == 6
