"""A multimodal checkpoint without preprocessor_config.json (as users bring them: copied without
it, or with a processor_config.json that names the processor class only) serves text, with a
warning; a request with an image then gets a 400 naming the missing file."""

from __future__ import annotations

import base64
import json
import logging
import shutil

import httpx
import pytest
from conftest import start_server
from media_files import blank_png

from qv import LLM, SamplingParams
from qv.errors import InvalidRequestError

IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(blank_png(32, 32)).decode()}}
MINIMAL_PROCESSOR = {"processor_class": "Qwen3VLProcessor"}  # what some checkpoints ship beside the separate files


@pytest.fixture(params=["no-file", "processor-class-only"])
def folder(request, tiny_dirs, tmp_path):
    out = tmp_path / "vision-without-preprocessor"
    shutil.copytree(tiny_dirs("tiny"), out)
    (out / "preprocessor_config.json").unlink()
    if request.param == "processor-class-only":
        (out / "processor_config.json").write_text(json.dumps(MINIMAL_PROCESSOR))
    return out


def test_serves_text_and_refuses_images_naming_the_file(folder, caplog):
    with caplog.at_level(logging.WARNING, logger="qv"):
        running, stop = start_server(folder)
    try:
        assert any("preprocessor_config.json" in r.getMessage() and "serves text" in r.getMessage()
                   for r in caplog.records), [r.getMessage() for r in caplog.records]
        with httpx.Client(base_url=running.url, timeout=120) as c:
            text = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
            assert text.status_code == 200, text.text
            assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3}).status_code == 200
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [
                {"type": "text", "text": "what is this?"}, IMAGE]}], "max_tokens": 3})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert "preprocessor_config.json" in err["message"] and err["param"] == "messages[0].content[1]", err
        assert err["type"] == "BadRequestError" and err["code"] == 400
    finally:
        stop()


def test_offline_llm_names_the_file(folder):
    import numpy as np

    llm = LLM(model=str(folder))
    assert llm.engine.multimodal is None and "preprocessor_config.json" in llm.engine.media_off
    ids = llm.tokenizer.encode("a <|vision_start|><|image_pad|><|vision_end|>", add_special_tokens=False)
    with pytest.raises(InvalidRequestError, match="preprocessor_config.json"):
        llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": np.zeros((32, 32, 3), np.uint8)}},
                     SamplingParams(max_tokens=2))
    assert llm.generate("hello", SamplingParams(max_tokens=2))[0].outputs[0].finish_reason == "length"
