"""LoRA adapters under tensor parallelism, on the CPU (one gloo worker): every rank writes its cut of an
adapter (cut like its Linear, as Clef's deltas are) into the same device slot when the driver pages it in,
and the step's rows grouped by slot travel in the upload. Three adapters and the base in one batch,
through max_loras=2 slots (so slots are rewritten mid-run), equal TP 1: greedy tokens, and logprobs
within 1e-4. It can fail: an adapter not written on the worker, cut wrongly or added twice through
the all-reduce moves the tokens (the adapters change the base's tokens, checked)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("peft")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from lora_fixtures import write_adapters  # noqa: E402
from qv.config import EngineConfig  # noqa: E402
from qv.engine.engine import LLMEngine  # noqa: E402
from util import run_greedy  # noqa: E402

LEVERS = dict(device="cpu", media_max_images=0, media_max_videos=0, max_model_len=1024, enable_lora=True,
              max_loras=2, max_lora_rank=16)
PROMPTS = [[5, 77, 13, 240, 9, 31, 8], [101, 3, 55, 19]]


def _serve(folder, modules: str, world: int) -> dict:
    eng = LLMEngine(EngineConfig(model=str(folder), tensor_parallel_size=world, lora_modules=modules, **LEVERS))
    try:
        return run_greedy(eng, {f"{name}-{i}": (ids, name) for name in (None, "attn", "gdn", "every")
                                for i, ids in enumerate(PROMPTS)}, max_tokens=6)
    finally:
        eng.shutdown()


def test_adapters_at_tp2_equal_tp1(tiny_dirs, tmp_path):
    folder = tiny_dirs("mixed")
    paths = write_adapters(folder, tmp_path)
    modules = " ".join(f"{n}={p}" for n, p in paths.items())
    one, two = _serve(folder, modules, 1), _serve(folder, modules, 2)
    for rid, (tokens, lps) in one.items():
        assert two[rid][0] == tokens, rid
        assert max(abs(a - b) for a, b in zip(two[rid][1], lps)) < 1e-4, rid
    assert any(one[f"{n}-0"][0] != one["None-0"][0] for n in paths), "the adapters changed nothing"
