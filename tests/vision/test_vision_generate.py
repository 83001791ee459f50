"""Greedy generation with images and videos: qv's processor, tower, mRoPE and text model against
transformers' processor + Qwen3_5ForConditionalGeneration.generate on the same tiny folder (fp32)."""

from __future__ import annotations

import pytest
import torch
from util import assert_close, rel_err
from vision_cases import BARE_VID, VID, expand, generate_cases, hf_inputs, qv_process

from qv.config import ModelConfig
from qv.model.batch import build_step_batch
from qv.model.cache import allocate_cache
from qv.model.vision import load_multimodal_model
from qv.model.vision_inputs import decode_positions, embed_with_vision, mrope_positions
from qv.model.vision_processor import VisionProcessor

NEW_TOKENS = 10
BOUND = 1e-5  # fp32 paths (DESIGN.md), against transformers in float64
CASES = {c["name"]: c for c in generate_cases()}


@pytest.fixture(scope="module")
def qv_model(vision_dir):
    return load_multimodal_model(vision_dir)


def qv_prepare(vision_dir, tokenizer, case):
    """Prompt ids (template-style video markers), positions, delta and input embeddings."""
    cfg = ModelConfig.from_dir(vision_dir)
    items = qv_process(VisionProcessor.from_dir(vision_dir), case)
    ids = torch.tensor(expand(tokenizer, vision_dir, case["text"].replace(BARE_VID, VID), items))
    pos, delta = mrope_positions(ids, [it.grid_thw for it in items if it.kind == "image"],
                                 [it.grid_thw for it in items if it.kind == "video"], cfg.image_token_id,
                                 cfg.video_token_id, cfg.vision.spatial_merge_size)
    return cfg, items, ids, pos, delta


def qv_greedy(text, tower, cfg, items, ids, pos, delta, eos: set[int]) -> tuple[list[int], list[torch.Tensor]]:
    """Prefill (logits of every prompt row) then one-token decode steps, as the engine runs them;
    returns the tokens and [prefill logits [T, V], step-1 logits [V], ...]."""
    bs, t = 16, ids.shape[0]
    blocks = (t + NEW_TOKENS) // bs + 1
    cache = allocate_cache(cfg, blocks, bs, 1, torch.float32, torch.float32, torch.float32, "cpu")
    table = list(range(blocks))
    vision = tower(torch.cat([it.pixel_values for it in items]), [it.grid_thw for it in items])
    embeds = embed_with_vision(text.embed, ids, vision, (cfg.image_token_id, cfg.video_token_id))
    batch = build_step_batch([t], [t], [table], [0], bs, logits_rows=list(range(t)))
    logits = [text.compute_logits(text.forward(ids, pos, batch, cache, inputs_embeds=embeds))]
    out = [int(logits[0][-1].argmax())]
    n = t
    while len(out) < NEW_TOKENS and out[-1] not in eos:
        batch = build_step_batch([1], [n + 1], [table], [0], bs)
        h = text.forward(torch.tensor([out[-1]]), decode_positions(n, 1, delta), batch, cache)
        logits.append(text.compute_logits(h[batch.logits_indices])[0])
        out.append(int(logits[-1].argmax()))
        n += 1
    return out, logits


@pytest.mark.parametrize("name", sorted(CASES))
def test_greedy_equals_hf(name, vision_dir, tokenizer, hf_model, hf_model_fp32, hf_processed, qv_model):
    """Same prompt ids as HF's processor, same greedy tokens as HF's generate (fp32), and every
    logit row on the way (prefill rows incl. the vision ones, each decode step) within the fp32
    bound of HF in float64 run over the prompt plus the generated tokens."""
    ref = hf_processed[name]
    cfg, items, ids, pos, delta = qv_prepare(vision_dir, tokenizer, CASES[name])
    assert ids.tolist() == ref["input_ids"][0].tolist()
    eos = hf_model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    inputs = hf_inputs(ref)
    with torch.no_grad():
        gen = hf_model_fp32.generate(**inputs, do_sample=False, max_new_tokens=NEW_TOKENS)
    hf_tokens = gen[0, ids.shape[0]:].tolist()
    mine, logits = qv_greedy(*qv_model, cfg, items, ids, pos, delta, eos)
    assert mine == hf_tokens
    t, fed = ids.shape[0], torch.tensor([mine[:-1]])  # the decode inputs, appended to the prompt
    long = dict(inputs, input_ids=torch.cat([inputs["input_ids"], fed], 1),
                attention_mask=torch.ones(1, t + fed.shape[1], dtype=torch.long),
                mm_token_type_ids=torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(fed)], 1))
    with torch.no_grad():
        exact = hf_model(**long).logits[0]
    errs = [assert_close(f"{name} prefill logits", logits[0], exact[:t], BOUND)]
    for i in range(1, len(mine)):
        errs.append(assert_close(f"{name} decode step {i} logits", logits[i], exact[t - 1 + i], BOUND))
    print(f"{name}: {t} prompt tokens, max logits rel err {max(errs):.2e}, tokens {mine}")


def test_vision_inputs_matter(vision_dir, tokenizer, hf_model, hf_processed, qv_model):
    """Controls: wrong positions or misplaced vision rows move the logits far past the bound, so
    the comparison above catches either mistake."""
    name = "gen-3"
    cfg, items, ids, pos, delta = qv_prepare(vision_dir, tokenizer, CASES[name])
    with torch.no_grad():
        ref = hf_model(**hf_inputs(hf_processed[name])).logits[0]
    flat = torch.arange(ids.shape[0]).expand(3, -1)  # plain 1-D RoPE positions
    assert rel_err(qv_greedy(*qv_model, cfg, items, ids, flat, 0, set())[1][0], ref) > 1e-3
    same = [k for k in range(1, 3) if items[k].num_tokens == items[0].num_tokens]
    if same:  # two images with equal token counts swapped: same shapes, wrong content
        swapped = list(items)
        swapped[0], swapped[same[0]] = items[same[0]], items[0]
        assert rel_err(qv_greedy(*qv_model, cfg, swapped, ids, pos, delta, set())[1][0], ref) > 1e-3
    zeroed = qv_greedy(*qv_model, cfg, [_blank(it) for it in items], ids, pos, delta, set())[1][0]
    assert rel_err(zeroed, ref) > 1e-3


def _blank(item):
    from dataclasses import replace

    return replace(item, pixel_values=torch.zeros_like(item.pixel_values))
