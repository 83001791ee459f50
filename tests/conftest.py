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
    "tests/spec/test_spec_engine.py::test_greedy_identical_with_speculation",
    "tests/spec/test_validate.py::test_fitted_model_passes_retrieval_and_acceptance",  # qv validate: engines + fit
    "tests/spec/test_validate.py::test_random_model_fails_retrieval_and_acceptance",
    "tests/oracles/test_paged_attention.py::test_paged_decode_variants",
    "tests/oracles/test_lm_head_top1.py::test_other_dtypes_and_widths",
    "tests/oracles/test_lm_head_top1.py::test_equals_reference",
    "tests/oracles/test_gated_delta_rule.py::test_split_prep_matches_fused",
    "tests/oracles/test_model_vs_transformers.py::test_logits_match_transformers",
    "tests/engine/test_engine_greedy.py",  # builds transformers' reference outputs first
    "tests/engine/test_async_scheduling.py",
    "tests/engine/test_prefix_cache.py",
    "tests/engine/test_long_prefill_share.py",
    "tests/engine/test_preemption_bound.py::test_thrash_reproduced_then_bounded",  # three engine runs to the end
    "tests/engine/test_prompt_logprobs.py::test_chunked_prompt_equals_transformers",
    "tests/engine/test_prompt_logprobs.py::test_preemption_mid_prefill",
    "tests/engine/test_memory_plan.py::test_every_slot_at_its_planned_context_runs_at_once",
    "tests/engine/test_structured.py::test_json_regex_choice_valid_and_neighbours_unchanged",
    "tests/engine/test_cache_dtypes.py::test_quantized_cache_logit_error",
    "tests/engine/test_cache_dtypes.py::test_int16_state_beats_fp16",
    "tests/engine/test_preemption.py::test_eight_requests_two_at_a_time",
    "tests/engine/test_bad_words.py::test_same_bans_with_speculative_decoding",
    "tests/engine/test_sampling.py::test_seeded_requests_reproducible_across_batches",
    "tests/clef/test_clef_answers.py",  # Clef's own code as the reference
    "tests/clef/test_clef_mixed_batch.py",
    "tests/clef/test_clef_embedded.py",
    "tests/clef/test_clef_engine.py::test_mixed_batches_through_the_engine",
    "tests/clef/test_clef_engine.py::test_clef_slots_bound_records_in_flight",
    "tests/clef/test_clef_engine.py::test_worker_refuses_a_record_that_is_not_the_encoded_one",
    "tests/clef/test_clef_chunks.py::test_chunks_of_512_equal_one_chunk",
    "tests/vision/test_vision_clef.py",
    "tests/vision/test_vision_engine.py::test_engine_equals_hf",
    "tests/vision/test_vision_video_file.py::test_video_file_equals_hf",
    "tests/vision/test_vision_engine_cache.py::test_mtp_drafts_on_mrope_positions",
    "tests/test_bench.py",  # whole-model benchmark runs
    "tests/test_kernels_aot.py::test_every_sm70_kernel_builds_for_sm70",
    "tests/test_launcher.py::test_serve_with_env_file",
    "tests/test_launcher.py::test_state_dir_holds_kernel_caches_and_the_tiny_model",
    "tests/test_model_chunks.py::test_chunked_prefill_equals_one_call",
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


def _seed_all(nodeid: str, request) -> None:
    seed = (zlib.crc32(nodeid.encode()) + request.config.getoption("--seed")) % (1 << 32)
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # pragma: no cover
        pass
    if "torch" in sys.modules:
        sys.modules["torch"].manual_seed(seed)


@pytest.fixture(scope="module", autouse=True)
def _seeded_module(request):
    """A module's own fixed seed before its module-scoped fixtures draw cases (autouse runs first in its
    scope): without it they would draw from whatever state the test before left, which depends on the
    tests selected and their order."""
    _seed_all(request.node.nodeid, request)


@pytest.fixture(autouse=True)
def _seeded(request):
    """Every test starts from its own fixed seed (the CRC of its id, plus `--seed`) for `random`, NumPy
    and torch, so a randomized test draws the same cases in every run and a failure reproduces."""
    _seed_all(request.node.nodeid, request)
    yield


@pytest.fixture(autouse=True)
def _restore_kernel_backend():
    """Each engine sets the process-wide kernel backend (QV_KERNELS); a test must not inherit the last
    test's (a CPU step after a GPU engine's `triton` would ask Triton for CPU tensors)."""
    from qv.kernels import get_backend, set_backend

    before = get_backend()
    yield
    set_backend(before)
