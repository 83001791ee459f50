"""The config.json of a few-layer Qwen3.5-27B (its layer shapes and 248,320-token vocabulary): with
load_format=random nothing else is needed, so GPU tests run the production shapes in seconds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def write_27b_config(out: Path, layers: int, max_model_len: int) -> str:
    from qv.model import tiny

    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(tiny.PRESETS, "27b-few", dict(tiny.PRESETS["27b"], num_hidden_layers=layers))
        _, special = tiny.tokenizer_json()
        config = tiny.build_config("27b-few", 0, special)  # the preset's own vocabulary (248320)
    assert config["vocab_size"] == 248320
    config["max_position_embeddings"] = max_model_len
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return str(out)
