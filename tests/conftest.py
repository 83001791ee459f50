"""Shared fixtures. On machines without CUDA, Triton kernels run through the interpreter, so the
CPU suite exercises the real kernel source at tiny shapes (TRITON_INTERPRET must be set before
triton is imported, hence here; triton_interpreter.py then makes its bf16 behave as on the GPU)."""

from __future__ import annotations

import os
import random
import sys
import zlib
from pathlib import Path

import pytest

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _HAS_CUDA = False
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).parent))

if os.environ.get("TRITON_INTERPRET") == "1":
    from triton_interpreter import patch_bf16

    patch_bf16()


def pytest_addoption(parser):
    parser.addoption("--seed", type=int, default=0,
                     help="added to every test's fixed seed (the CRC of its id): other random cases, reproducibly")


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device with `pytest -m gpu`)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """Checkpoint folders of every tiny preset, built once per session."""
    from qv.model.tiny import make_tiny

    root = tmp_path_factory.mktemp("tiny")
    cache: dict[tuple, Path] = {}

    def get(preset: str = "tiny", seed: int = 0, mtp: bool = False) -> Path:
        key = (preset, seed, mtp)
        if key not in cache:
            cache[key] = make_tiny(root / f"{preset}-{seed}-{int(mtp)}", preset, seed, mtp)
        return cache[key]

    return get


_TINY_PRESET = object()  # tiny_engine's default model: the tiny preset's folder


@pytest.fixture(scope="session")
def tiny_engine(tiny_dirs):
    """Every engine a test builds for its behaviour: `tiny_engine(**levers)` is the offline LLM (its
    LLMEngine is `.engine`) over the tiny preset's checkpoint. preset/seed/mtp pick another tiny
    folder; model=PATH a folder the test made, model=None the embedded tiny model."""
    from qv import LLM

    def make(*, model=_TINY_PRESET, preset: str = "tiny", seed: int = 0, mtp: bool = False, **levers) -> LLM:
        if model is _TINY_PRESET:
            model = tiny_dirs(preset, seed, mtp)
        return LLM(model=None if model is None else str(model), **levers)

    return make


@pytest.fixture(autouse=True)
def _seeded(request):
    """Every test starts from its own fixed seed (the CRC of its id, plus `--seed`) for `random`, NumPy
    and torch, so a randomized test draws the same cases in every run and a failure reproduces."""
    seed = (zlib.crc32(request.node.nodeid.encode()) + request.config.getoption("--seed")) % (1 << 32)
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # pragma: no cover
        pass
    if "torch" in sys.modules:
        sys.modules["torch"].manual_seed(seed)
    yield


@pytest.fixture(autouse=True)
def _restore_kernel_backend():
    """Each engine sets the process-wide kernel backend (QV_KERNELS); a test must not inherit the last
    test's (a CPU step after a GPU engine's `triton` would ask Triton for CPU tensors)."""
    from qv.kernels import get_backend, set_backend

    before = get_backend()
    yield
    set_backend(before)
