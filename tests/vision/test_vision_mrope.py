"""mRoPE positions of prompts with images and videos against HF Qwen3_5Model.get_rope_index."""

from __future__ import annotations

import pytest
import torch
from vision_cases import processor_cases

from qv.config import ModelConfig
from qv.model.vision_inputs import decode_positions, mrope_positions

NAMES = [c["name"] for c in processor_cases()]


@pytest.mark.parametrize("name", NAMES)
def test_positions_equal_hf(name, vision_dir, hf_model, hf_processed):
    ref = hf_processed[name]
    if "error" in ref:
        pytest.skip("HF rejects this input (tested in test_processor)")
    cfg = ModelConfig.from_dir(vision_dir)
    ids = ref["input_ids"]
    images = ref.get("image_grid_thw")
    videos = ref.get("video_grid_thw")
    pos_ref, delta_ref = hf_model.model.get_rope_index(ids, ref["mm_token_type_ids"], image_grid_thw=images,
                                                       video_grid_thw=None if videos is None else videos.clone())
    pos, delta = mrope_positions(ids[0], [] if images is None else images.tolist(),
                                 [] if videos is None else videos.tolist(), cfg.image_token_id, cfg.video_token_id,
                                 cfg.vision.spatial_merge_size)
    assert torch.equal(pos, pos_ref[:, 0]), "positions differ"
    assert delta == int(delta_ref)


def test_text_only_and_decode():
    pos, delta = mrope_positions([5, 6, 7], [], [], 1, 2, 2)
    assert torch.equal(pos, torch.arange(3).expand(3, 3)) and delta == 0
    assert torch.equal(decode_positions(10, 2, -4), torch.tensor([[6, 7]] * 3))


def test_grid_mismatch_is_an_error():
    with pytest.raises(ValueError, match="needs 4"):
        mrope_positions([9, 1, 1, 9], [(1, 4, 4)], [], 1, 2, 2)
    with pytest.raises(ValueError, match="more image runs than grids"):
        mrope_positions([1, 9, 1], [(1, 2, 2)], [], 1, 2, 2)
    with pytest.raises(ValueError, match="more video frame grids"):
        mrope_positions([2, 9], [], [(2, 2, 2)], 1, 2, 2)
