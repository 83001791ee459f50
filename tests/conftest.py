"""Shared fixtures. On machines without CUDA, Triton kernels run through the interpreter, so the
CPU suite exercises the real kernel source at tiny shapes (TRITON_INTERPRET must be set before
triton is imported, hence here; triton_interpreter.py then makes its bf16 behave as on the GPU)."""

from __future__ import annotations

import os
import sys
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


# `-m "not slow"` leaves these out (node-id prefixes: a file, a test, or one parametrization): each took
# 5 s or more of call + setup on a loaded 2-core CPU machine (`pytest --durations=0`). CI runs them all.
SLOW_TESTS = (
    "tests/parallel/",  # worker processes over gloo, each starting its own engine
    "tests/spec/test_spec_distribution.py",  # fits an MTP head first
    "tests/spec/test_spec_graphs.py",
    "tests/spec/test_spec_engine.py::test_acceptance_lengths",
    "tests/spec/test_spec_engine.py::test_more_sequences_than_spec_max_seqs",
    "tests/spec/test_spec_engine.py::test_chunked_prefill_quantized_caches_and_preemption",
    "tests/spec/test_spec_engine.py::test_stop_string_inside_accepted_run",
    "tests/oracles/test_paged_attention.py::test_paged_attention_new_kv",
    "tests/oracles/test_lm_head_top1.py::test_near_tie_needs_the_exact_rescoring",
    "tests/server/test_schemathesis.py",  # property-based requests over every route
    "tests/server/test_fuzz.py::test_schema_fuzz_never_gives_5xx",
    "tests/server/test_errors.py::test_mutated_bodies_never_give_5xx",
    "tests/server/test_tool_calls_constrained.py::test_required_calls_always_parse_and_validate",
    "tests/server/test_shutdown.py::test_sigterm_drains_and_exits_within_the_grace",
)


def _mark_slow(items) -> None:
    for item in items:
        if item.nodeid.startswith(SLOW_TESTS):
            item.add_marker(pytest.mark.slow)


def pytest_collection_modifyitems(config, items):
    _mark_slow(items)
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


@pytest.fixture(autouse=True)
def _restore_kernel_backend():
    """Each engine sets the process-wide kernel backend (QV_KERNELS); a test must not inherit the last
    test's (a CPU step after a GPU engine's `triton` would ask Triton for CPU tensors)."""
    from qv.kernels import get_backend, set_backend

    before = get_backend()
    yield
    set_backend(before)
