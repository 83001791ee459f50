"""A 4-bit tiny model on the CPU beside its dense twin (the same weights dequantized by the test): Clef's
low-rank deltas on 4-bit linears, the Clef head's output-embedding rows of a 4-bit lm_head, and the MTP head
loaded from 4-bit mtp.* tensors drafting under speculation (greedy output unchanged by speculation)."""

from __future__ import annotations

import torch

from qv.clef.adapters import AdapterModule, attach
from qv.clef.head import output_embedding_rows
from qv.kernels.linear import GPTQWeight
from qv.kernels.linear.reference import dequantize_gptq
from qv.llm import LLM, SamplingParams
from qv.model.batch import build_step_batch
from qv.model.cache import allocate_cache
from qv.model.qwen3_5 import load_text_model
from test_int4_weights import dense_twin4, write_gptq4
from util import assert_close

QCFG = {"quant_method": "gptq", "bits": 4, "group_size": 16, "sym": False, "desc_act": True,
        "checkpoint_format": "gptq_v2", "lm_head": True}


def _logits(model, ids, delta_rows):
    t = ids.numel()
    batch = build_step_batch([t], [t], [[0, 1, 2]], [0], 16, logits_rows=list(range(t)), delta_rows=delta_rows)
    cache = allocate_cache(model.cfg, 3, 16, 1, torch.float32, torch.float32, torch.float32, "cpu")
    return model.compute_logits(model.forward(ids, torch.arange(t), batch, cache)[batch.logits_indices])


def test_clef_deltas_and_head_rows_on_a_4bit_model(tiny_dirs, tmp_path):
    src = tiny_dirs("gqa3")  # untied: a 4-bit lm_head of its own
    q = write_gptq4(src, tmp_path / "g4", r"(mlp|in_proj_qkv|in_proj_z|out_proj|self_attn)\.\w+$|^lm_head$",
                    dict(QCFG, dynamic={}), seed=4)
    twin = dense_twin4(q, tmp_path / "dense")
    four, dense = load_text_model(str(q)), load_text_model(str(twin))
    gate = four.layers[0].mlp.gate_up.parts[0].weight
    assert isinstance(gate, GPTQWeight) and gate.bits == 4
    gen = torch.Generator().manual_seed(11)
    modules = [AdapterModule(name, torch.randn(4, k, generator=gen) * 0.3, torch.randn(n, 4, generator=gen) * 0.3, 0.5)
               for name, n, k in [("model.layers.0.mlp.up_proj", 96, 48),
                                  ("model.layers.0.linear_attn.in_proj_qkv", 112, 48),
                                  ("model.layers.0.linear_attn.out_proj", 48, 48),
                                  ("model.layers.1.self_attn.o_proj", 48, 96)]]
    for model in (four, dense):
        attach(model, modules)
    ids = torch.arange(5, 30) % four.cfg.vocab_size
    rows = list(range(3, 17))
    got, want = _logits(four, ids, rows), _logits(dense, ids, rows)
    assert_close("4-bit model with Clef deltas vs its dense twin", got, want, 1e-5)
    plain = _logits(four, ids, None)
    assert (got - plain).abs().max() > 1e-2  # the deltas changed the logits (so the comparison can fail)
    assert torch.equal(got[:3], plain[:3])  # rows before the delta rows are untouched
    # the Clef head's rows of the output embedding: the 4-bit lm_head dequantized, the dense twin's rows
    head = four.lm_head.weight
    assert isinstance(head, GPTQWeight) and head.bits == 4
    pick = torch.tensor([0, 7, 100, four.cfg.vocab_size - 1])
    rows_4 = output_embedding_rows(head, pick)
    assert torch.equal(rows_4, dequantize_gptq(head)[pick])
    assert_close("Clef head rows", rows_4, dense.lm_head.weight[pick].float(), 1e-6)


def test_mtp_head_from_4bit_tensors_drafts(tiny_dirs, tmp_path):
    src = tiny_dirs("tiny", mtp=True)
    q = write_gptq4(src, tmp_path / "g4mtp", r"^(mtp\.(fc|layers\.0\.(mlp|self_attn)\.\w+)|.*mlp\.\w+)$",
                    dict(QCFG, desc_act=False, lm_head=False, dynamic={r"-:.*visual.*": {}}), seed=6)
    prompts = ["one two three", "a b a b a b"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    base = [o.outputs[0].token_ids for o in LLM(model=str(q)).generate(prompts, params)]
    llm = LLM(model=str(q), spec="mtp", spec_k=2)
    head = llm.engine.spec.head
    assert all(isinstance(w, GPTQWeight) and w.bits == 4 for w in (head.fc.weight, head.layer.mlp.gate_up.parts[0].weight))
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == base

