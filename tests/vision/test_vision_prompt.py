"""MultimodalPrompt: chunked prefill with vision (chunks cutting through images and video frames)
against transformers, and the media hashes of the prefix-cache key."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from util import assert_close
from vision_cases import BARE_VID, VID, generate_cases, hf_inputs, image, qv_process, token_ids

from qv.config import ModelConfig
from qv.model.batch import build_step_batch
from qv.model.cache import allocate_cache
from qv.model.vision import load_multimodal_model
from qv.model.vision_inputs import mrope_positions
from qv.model.vision_prompt import MultimodalPrompt
from qv.model.vision_processor import VisionProcessor

CASE = {c["name"]: c for c in generate_cases()}["gen-mixed"]


def build(vision_dir, tokenizer, text, items) -> MultimodalPrompt:
    cfg = ModelConfig.from_dir(vision_dir)
    return MultimodalPrompt.build(tokenizer(text)["input_ids"], items, token_ids(vision_dir),
                                  lambda s: tokenizer(s, add_special_tokens=False)["input_ids"],
                                  cfg.vision.spatial_merge_size)


@pytest.mark.parametrize("chunk", [7, 16])
def test_chunked_prefill_equals_hf(chunk, vision_dir, tokenizer, hf_model, hf_processed):
    """Prefill in chunks, each chunk's embeddings from only the items it touches, each item
    encoded on its own: every prompt row's logits match HF (float64) on the whole prompt."""
    cfg = ModelConfig.from_dir(vision_dir)
    text, tower = load_multimodal_model(vision_dir)
    items = qv_process(VisionProcessor.from_dir(vision_dir), CASE)
    mp = build(vision_dir, tokenizer, CASE["text"].replace(BARE_VID, VID), items)
    assert mp.token_ids == hf_processed["gen-mixed"]["input_ids"][0].tolist()
    t, bs = len(mp), 16
    blocks = list(range(t // bs + 1))
    cache = allocate_cache(cfg, len(blocks), bs, 1, torch.float32, torch.float32, torch.float32, "cpu")
    encoded: dict[int, torch.Tensor] = {}
    rows = []
    for start in range(0, t, chunk):
        end = min(start + chunk, t)
        for i in mp.items_in(start, end):  # encode on first need, as an engine would
            encoded.setdefault(i, tower(items[i].pixel_values, [items[i].grid_thw]))
        ids = torch.tensor(mp.token_ids[start:end])
        batch = build_step_batch([end - start], [end], [blocks], [0], bs, logits_rows=list(range(end - start)))
        h = text.forward(ids, mp.positions_for(start, end), batch, cache,
                         inputs_embeds=mp.embed_chunk(text.embed, ids, start, encoded))
        rows.append(text.compute_logits(h))
    assert len(encoded) == len(items)
    with torch.no_grad():
        ref = hf_model(**hf_inputs(hf_processed["gen-mixed"])).logits[0]
    err = assert_close(f"chunked prefill (chunk {chunk})", torch.cat(rows), ref, 1e-5)
    print(f"chunk {chunk}: rel err {err:.2e}")


def test_positions_and_items(vision_dir, tokenizer):
    items = qv_process(VisionProcessor.from_dir(vision_dir), CASE)
    mp = build(vision_dir, tokenizer, CASE["text"].replace(BARE_VID, VID), items)
    cfg = ModelConfig.from_dir(vision_dir)
    pos, delta = mrope_positions(mp.token_ids, [it.grid_thw for it in items if it.kind == "image"],
                                 [it.grid_thw for it in items if it.kind == "video"], cfg.image_token_id,
                                 cfg.video_token_id, cfg.vision.spatial_merge_size)
    t = len(mp)
    assert torch.equal(mp.positions_for(0, t), pos) and mp.rope_delta == delta
    tail = mp.positions_for(t - 2, t + 3)
    assert torch.equal(tail[:, :2], pos[:, t - 2:]) and torch.equal(tail[:, 2:], (torch.arange(t, t + 3) + delta).expand(3, 3))
    assert [it.kind for it in items] == ["image", "video", "image"]
    arr = np.asarray(mp.token_ids)
    for i, (a, b) in enumerate(mp.item_span):
        assert mp.items_in(a, a + 1) == [i] and mp.items_in(b - 1, b) == [i]
        assert int(np.isin(arr[a:b], [cfg.image_token_id, cfg.video_token_id]).sum()) == items[i].num_tokens
    assert mp.items_in(0, mp.item_span[0][0]) == []
    with pytest.raises(KeyError, match="media item 0"):
        a = mp.item_span[0][0]
        mp.embed_chunk(lambda x: torch.zeros(x.shape[0], 4), torch.tensor(mp.token_ids[a:a + 2]), a, {})


def test_media_hashes_carry_content(vision_dir, tokenizer):
    proc = VisionProcessor.from_dir(vision_dir)
    text = f"<|im_start|>user\nlook {'<|vision_start|><|image_pad|><|vision_end|>'} now<|im_end|>\n"
    a = build(vision_dir, tokenizer, text, [proc.image(image(1, 64, 64))])
    b = build(vision_dir, tokenizer, text, [proc.image(image(2, 64, 64))])  # same size, other pixels
    c = build(vision_dir, tokenizer, text, [proc.image(image(1, 64, 64))])
    assert a.token_ids == b.token_ids  # the pad tokens alone cannot tell the images apart
    assert a.mm_hashes == c.mm_hashes and a.mm_hashes != b.mm_hashes
    (pos, _), = a.mm_hashes
    assert a.token_ids[pos] == token_ids(vision_dir).image and a.token_ids[pos - 1] == token_ids(vision_dir).vision_start
