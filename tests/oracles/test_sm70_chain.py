"""No Triton tl.dot under the sm70 chain (it has no tensor-core path below sm_80 and Triton >= 3.3 computed
it wrong there, sglang #7467).

CPU: every op whose Triton implementation reaches a tl.dot kernel (its module's kernels and those of the
qv.kernels modules it takes functions from, with the @triton.jit helpers they call) has an sm70
implementation in registry.TABLE, so the chain never falls back to it. The ops whose sm70 kernels come
listed in PENDING are strict xfails (an XPASS fails).
GPU: a GPTQ tiny model served by the engine under kernels=sm70 (fp16, chunked prefill, n-gram
speculation: verification rows) launches no tl.dot kernel from any other op, and, once those branches
land, none at all."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch

from kernel_cases import K, randn
from qv.kernels import registry
from test_linear import gptq_weight
from tl_dot_recorder import _is_kernel, python_function, record_launches, uses_dot

PENDING: dict[str, str] = {}  # op -> why it still has no sm70 kernel (a strict xfail each)


def reachable_kernels(module_name: str) -> dict[str, object]:
    """Triton kernels of a module and of the qv.kernels modules whose functions, classes or kernels it
    imports, transitively: module-qualified name -> Python function."""
    seen, kernels, todo = set(), {}, [module_name]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for value in vars(importlib.import_module(name)).values():
            if _is_kernel(value):
                fn = python_function(value)
                kernels[f"{fn.__module__}.{fn.__qualname__}"] = fn
                continue
            if inspect.ismodule(value):
                owner = value.__name__
            elif inspect.isfunction(value) or inspect.isclass(value):
                owner = value.__module__
            else:
                continue
            if owner.startswith("qv.kernels.") and owner != name:
                todo.append(owner)
    return kernels


def _ops_with_dot() -> list[str]:
    return [op for op, row in registry.TABLE.items()
            if any(uses_dot(fn) for fn in reachable_kernels(f"qv.kernels.{row['triton']}").values())]


def test_the_scan_finds_tl_dot():
    """The scan sees the GPTQ GEMM's tl.dot (through a @triton.jit helper) and none in the norms."""
    linear = reachable_kernels("qv.kernels.linear.triton")
    assert uses_dot(linear["qv.kernels.linear.triton.gptq_matmul_kernel"])
    assert not any(uses_dot(fn) for fn in reachable_kernels("qv.kernels.rms_norm.triton").values())
    assert "linear" in _ops_with_dot() and "rms_norm" not in _ops_with_dot()


@pytest.mark.parametrize("op", [pytest.param(op, marks=pytest.mark.xfail(strict=True, reason=PENDING[op]))
                                if op in PENDING else op for op in _ops_with_dot()])
def test_ops_with_tl_dot_have_an_sm70_kernel(op):
    assert registry.TABLE[op]["sm70"] is not None, (
        f"{op}: its Triton implementation uses tl.dot and it has no sm70 implementation, so the sm70 chain runs "
        f"tl.dot; ops in that state: {', '.join(o for o in _ops_with_dot() if registry.TABLE[o]['sm70'] is None)}")


def test_recorder_sees_a_tl_dot_launch():
    """Negative control for the engine test: the Triton chain's GPTQ GEMM (20 rows) is recorded and flagged."""
    w = gptq_weight(40, 64, 16, False, False, torch.float32)
    with record_launches() as launched, K.backend("triton"):
        K.linear(randn(20, 64), w)
    assert "qv.kernels.linear.triton.gptq_matmul_kernel" in launched.with_dot()


@pytest.fixture(scope="module")
def sm70_engine_launches(tiny_dirs, tmp_path_factory):
    """Triton kernels launched by the engine serving a GPTQ tiny model under kernels=sm70 in fp16: two
    prompts (one past the token budget: chunked prefill), greedy, n-gram speculation (k + 1 rows a
    sequence), CUDA graphs on."""
    from qv import LLM, SamplingParams
    from qv.model.quantize import quantize_checkpoint

    folder = quantize_checkpoint(tiny_dirs("tiny"), tmp_path_factory.mktemp("gptq") / "tiny", group_size=16)
    prompts = [{"prompt_token_ids": [(7 * i) % 250 for i in range(n)]} for n in (300, 37)]
    with record_launches() as launched:
        llm = LLM(model=str(folder), kernels="sm70", dtype="float16", max_num_batched_tokens=128, spec="ngram",
                  spec_k=3, kv_cache_bytes=256 << 20)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
    assert launched.kernels, "the recorder saw no Triton launch at all"
    return launched


@pytest.mark.gpu
def test_sm70_engine_runs_no_tl_dot_of_other_ops_gpu(sm70_engine_launches):
    pending = tuple(f"qv.kernels.{op}." for op in PENDING) or ("\0",)
    dots = sm70_engine_launches.with_dot()
    assert [d for d in dots if not d.startswith(pending)] == [], f"tl.dot kernels under the sm70 chain: {dots}"


@pytest.mark.gpu
def test_sm70_engine_runs_no_tl_dot_gpu(sm70_engine_launches):
    assert sm70_engine_launches.with_dot() == []
