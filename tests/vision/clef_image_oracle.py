"""Cloudflare's own `systemone()` (clef-finetune's vendored joint_schema_model.py) with Hugging
Face's processor, on pickled Clef records with images, in a separate process for the reason
hf_processor_oracle.py gives: `python clef_image_oracle.py RELEASE_DIR TV_DIR IN OUT`.

The model is their ClefModel over transformers' Qwen3_5ForConditionalGeneration (vision tower
included) and their JointSchemaHead, fp32 on CPU. For each record it writes systemone's response
and the unrounded per-option probabilities (caught from the model's output on the way).
"""

import json
import pickle
import sys
from pathlib import Path

from hf_processor_oracle import use_side_torchvision


def main(release: str, tv_dir: str, in_path: str, out_path: str) -> None:
    use_side_torchvision(tv_dir)
    import torch
    from clef_finetune.jsm import load_jsm
    from safetensors.torch import load_file
    from transformers import AutoProcessor, Qwen3_5ForConditionalGeneration

    jsm, folder = load_jsm(), Path(release)
    backbone = Qwen3_5ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    head = jsm.JointSchemaHead(**json.loads((folder / "joint_head_config.json").read_text()))
    head.load_state_dict(load_file(str(folder / "joint_head.safetensors")), strict=True)
    model = jsm.ClefModel(backbone, head.float()).eval()
    processor = AutoProcessor.from_pretrained(folder)
    with open(in_path, "rb") as f:
        bodies = pickle.load(f)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/
    from clef_systemone import systemone_with_probabilities

    results = [systemone_with_probabilities(jsm, model, processor, body) for body in bodies]
    with open(out_path, "wb") as f:
        pickle.dump(results, f)


if __name__ == "__main__":
    main(*sys.argv[1:5])
