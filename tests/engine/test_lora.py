"""Served LoRA adapters against transformers with the PEFT adapter merged (greedy tokens and their
logprobs, teacher-forced), a batch mixing three adapters and the base against each run alone,
adapters paged through fewer device slots than adapters, and bad adapters refused by name with the
others still serving."""

from __future__ import annotations

import json

import pytest
import torch

from lora_fixtures import ADAPTERS, merged_model, write_adapters
from qv.engine.lora_rows import LoraError, parse_lora_modules
from qv.engine.request import SamplingParams
from qv.errors import ConfigError
from util import run_greedy

PROMPTS = [[5, 77, 13, 240, 9, 31, 8], [101, 3, 55], [17, 17, 42, 250, 6, 1, 90, 33, 12, 4, 77]]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def setup(tiny_dirs, tmp_path_factory):
    model_dir = tiny_dirs("tiny")
    return model_dir, write_adapters(model_dir, tmp_path_factory.mktemp("lora"))


def _engine(tiny_engine, model_dir, paths, **levers):
    modules = " ".join(f"{n}={p}" for n, p in paths.items())
    levers = {"enable_lora": True, "lora_modules": modules, "max_lora_rank": 16, "max_loras": 3, **levers}
    return tiny_engine(model=str(model_dir), **levers).engine


def _run(engine, requests):
    return run_greedy(engine, requests, MAX_TOKENS)


@torch.no_grad()
def _oracle(model, ids: list[int], tokens: list[int]) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and their logprobs, teacher-forced along `tokens`."""
    seq = torch.tensor([ids + tokens])
    logp = torch.log_softmax(model(input_ids=seq).logits[0].double(), -1)[len(ids) - 1:-1]
    return logp.argmax(-1).tolist(), [float(logp[i, t]) for i, t in enumerate(tokens)]


def test_each_adapter_equals_transformers_with_it_merged(setup, tiny_engine):
    model_dir, paths = setup
    engine = _engine(tiny_engine, model_dir, paths)
    got = _run(engine, {f"{name}-{i}": (ids, name) for name in paths for i, ids in enumerate(PROMPTS)})
    base = _run(engine, {f"base-{i}": (ids, None) for i, ids in enumerate(PROMPTS)})
    for name, path in paths.items():
        model = merged_model(model_dir, path)
        for i, ids in enumerate(PROMPTS):
            tokens, lps = got[f"{name}-{i}"]
            want, want_lps = _oracle(model, ids, tokens)
            assert tokens == want, f"{name} prompt {i}: greedy tokens differ from the merged model's"
            assert max(abs(a - b) for a, b in zip(lps, want_lps)) < 1e-4, f"{name} prompt {i}: logprobs"
        assert any(got[f"{name}-{i}"][0] != base[f"base-{i}"][0] for i in range(len(PROMPTS))), \
            f"adapter {name} changed no token (a test that cannot fail)"


def test_mixed_batch_equals_each_alone(setup, tiny_engine):
    model_dir, paths = setup
    engine = _engine(tiny_engine, model_dir, paths)
    names = [None, *paths]
    mixed = _run(engine, {f"{n}-{i}": (ids, n) for n in names for i, ids in enumerate(PROMPTS)})
    for n in names:
        for i, ids in enumerate(PROMPTS):
            alone = _run(engine, {"alone": (ids, n)})["alone"]
            got = mixed[f"{n}-{i}"]
            assert got[0] == alone[0], f"{n} prompt {i}: tokens differ in the mixed batch"
            assert max(abs(a - b) for a, b in zip(got[1], alone[1])) < 1e-5


def test_more_adapters_than_device_slots_are_paged(setup, tiny_engine):
    """max_loras=1: three adapters' requests at once run in turns through one slot, with the same results."""
    model_dir, paths = setup
    wide = _engine(tiny_engine, model_dir, paths)
    want = _run(wide, {f"{n}-{i}": (ids, n) for n in paths for i, ids in enumerate(PROMPTS)})
    one = _engine(tiny_engine, model_dir, paths, max_loras=1)
    got = _run(one, {f"{n}-{i}": (ids, n) for n in paths for i, ids in enumerate(PROMPTS)})
    assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in want.items()}
    assert one.lora.num_swaps >= len(paths)


def test_bad_adapters_are_refused_by_name(setup, tiny_engine, tmp_path):
    model_dir, paths = setup
    small = {n: p for n, p in paths.items() if ADAPTERS[n][0] <= 8}  # "every" (rank 16) is over this cap
    engine = _engine(tiny_engine, model_dir, small, max_lora_rank=8)
    with pytest.raises(LoraError, match="no such folder"):
        engine.lora.load("missing", str(tmp_path / "nowhere"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(LoraError, match="adapter_config.json"):
        engine.lora.load("empty", str(empty))
    with pytest.raises(LoraError, match="above max_lora_rank 8"):
        engine.lora.load("big", str(setup[1]["every"]))
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    cfg = json.loads((setup[1]["attn"] / "adapter_config.json").read_text())
    (wrong / "adapter_config.json").write_text(json.dumps(cfg))
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(setup[1]["attn"] / "adapter_model.safetensors"))
    key = next(k for k in tensors if "lora_B" in k)
    tensors[key] = torch.zeros(tensors[key].shape[0] + 1, tensors[key].shape[1])
    save_file(tensors, str(wrong / "adapter_model.safetensors"))
    with pytest.raises(LoraError, match="do not fit"):
        engine.lora.load("wrong", str(wrong))
    assert [n for n, _ in engine.lora.names()] == ["attn", "gdn"]
    assert _run(engine, {"ok": (PROMPTS[0], "attn")})["ok"][0]  # the others keep serving
    engine.add_request("busy", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=2), lora_name="gdn")
    with pytest.raises(LoraError, match="in use by 1 running"):
        engine.lora.unload("gdn")
    _run(engine, {})
    engine.lora.unload("gdn")
    with pytest.raises(LoraError, match="does not exist"):
        engine.add_request("gone", PROMPTS[1], SamplingParams(max_tokens=1), lora_name="gdn")


def test_vllm_lora_command_line():
    """vLLM's flags: --lora-modules repeatable (name=path or JSON objects), the others one lever each."""
    import shlex

    from qv.cli import _overrides, build_parser
    from qv.config import EngineConfig

    line = ("serve /m --enable-lora 1 --lora-modules a=/x b=/y --lora-modules '{\"name\": \"c\", \"path\": \"/z\"}' "
            "--max-loras 4 --max-lora-rank 64 --max-cpu-loras 8 --allow-runtime-lora-updating 1")
    got = _overrides(build_parser().parse_args(shlex.split(line)))
    assert parse_lora_modules(got["lora_modules"]) == {"a": "/x", "b": "/y", "c": "/z"}
    cfg = EngineConfig(**got)
    assert (cfg.enable_lora, cfg.max_loras, cfg.max_lora_rank, cfg.max_cpu_loras, cfg.allow_runtime_lora_updating) == (
        True, 4, 64, 8, True)


def test_lora_modules_and_levers():
    assert parse_lora_modules("a=/x b=/y,c=/z") == {"a": "/x", "b": "/y", "c": "/z"}
    assert parse_lora_modules(json.dumps(["a=/x", json.dumps({"name": "b", "path": "/y"})])) == {"a": "/x", "b": "/y"}
    assert parse_lora_modules('[{"name": "b", "path": "/y", "base_model_name": "m"}]') == {"b": "/y"}
    with pytest.raises(ConfigError, match="name=path"):
        parse_lora_modules("oops")


def _cached(engine, rid, ids, name) -> int:
    engine.add_request(rid, ids, SamplingParams(temperature=0.0, max_tokens=1), lora_name=name)
    cached = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                cached = out.num_cached_tokens
    return cached


def test_prefix_cache_is_salted_by_adapter(setup, tiny_engine):
    """A prompt cached for the base (or another adapter) is never reused by an adapter, but is by the same one."""
    model_dir, paths = setup
    engine = _engine(tiny_engine, model_dir, paths, block_size=16, gdn_snapshot_interval=32)
    ids = [(7 * i + 3) % 250 + 1 for i in range(80)]
    assert _cached(engine, "b0", ids, None) == 0
    assert _cached(engine, "b1", ids, None) > 0  # the base reuses its own prefix: the check can see a hit
    assert _cached(engine, "a0", ids, "attn") == 0
    assert _cached(engine, "g0", ids, "gdn") == 0
    assert _cached(engine, "a1", ids, "attn") > 0


def test_adapter_slots_are_in_the_memory_plan(setup, tiny_engine):
    """The device slots are reserved at start and counted with the weights (max_loras x rank x (K + N))."""
    model_dir, _ = setup
    plain = tiny_engine(model=str(model_dir)).engine.memory_plan.weight_bytes
    one = tiny_engine(model=str(model_dir), enable_lora=True, max_loras=1, max_lora_rank=8).engine.memory_plan
    two = tiny_engine(model=str(model_dir), enable_lora=True, max_loras=2, max_lora_rank=8).engine.memory_plan
    per_slot = one.weight_bytes - plain
    assert per_slot > 0 and two.weight_bytes - plain >= 2 * per_slot - 64 * 8


def test_speculation_verifies_drafts_with_the_adapter(setup, tiny_engine, tiny_dirs):
    """Drafts (n-gram: from the tokens, MTP: from the base's head) are verified by the adapter's model: the
    greedy tokens equal those without speculation."""
    model_dir, paths = setup
    mtp_dir = tiny_dirs("tiny", mtp=True)  # same shapes: the adapters fit
    reqs = {f"{n}-{i}": (ids, n) for n in [None, *paths] for i, ids in enumerate(PROMPTS)}
    want = _run(_engine(tiny_engine, mtp_dir, paths, spec="off"), reqs)
    for spec in ("ngram", "mtp"):
        got = _run(_engine(tiny_engine, mtp_dir, paths, spec=spec, spec_k=2), reqs)
        assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in want.items()}, spec


def test_gptq_int8_weights_mix_adapters(setup, tiny_engine, tmp_path):
    """With GPTQ-Int8 weights (`qv quantize`, group 32) a mixed batch still equals each request alone."""
    from qv.model.quantize import quantize_checkpoint

    model_dir, paths = setup
    quantized = tmp_path / "gptq"
    quantize_checkpoint(model_dir, quantized, bits=8, group_size=32)
    engine = _engine(tiny_engine, quantized, paths)
    reqs = {f"{n}-{i}": (ids, n) for n in [None, *paths] for i, ids in enumerate(PROMPTS[:2])}
    mixed = _run(engine, reqs)
    for rid, req in reqs.items():
        assert _run(engine, {"alone": req})["alone"][0] == mixed[rid][0], rid
    assert mixed["attn-0"][0] != mixed["None-0"][0] or mixed["every-0"][0] != mixed["None-0"][0]


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
def test_gpu_adapters_equal_transformers_with_graphs(setup, tiny_engine, graphs):
    """On the GPU with the Triton kernels (fp32: IEEE dots) and CUDA graphs: each adapter's greedy tokens
    and logprobs equal the merged model's, decode steps holding adapter rows replay a graph, and a batch
    of three adapters plus the base equals each request alone."""
    model_dir, paths = setup
    engine = _engine(tiny_engine, model_dir, paths, device="cuda", dtype="float32", kernels="triton",
                     cuda_graphs=graphs)
    replayed = []
    forward = engine.runner._forward

    def spied(st):
        out = forward(st)
        if st.graphs is not None and st.batch.delta_rows is not None:
            replayed.append(int(st.batch.delta_rows.rows.numel()))
        return out

    engine.runner._forward = spied
    reqs = {f"{n}-{i}": (ids, n) for n in [None, *paths] for i, ids in enumerate(PROMPTS)}
    mixed = _run(engine, reqs)
    for name, path in paths.items():
        model = merged_model(model_dir, path)
        for i, ids in enumerate(PROMPTS):
            tokens, lps = mixed[f"{name}-{i}"]
            want, want_lps = _oracle(model, ids, tokens)
            assert tokens == want and max(abs(a - b) for a, b in zip(lps, want_lps)) < 1e-4, (name, i)
    for rid, req in reqs.items():
        assert _run(engine, {"alone": req})["alone"][0] == mixed[rid][0], rid
    assert bool(replayed) == graphs, "decode steps with adapter rows should replay graphs exactly when they are on"


@pytest.mark.gpu
def test_gpu_speculation_and_gptq(setup, tiny_engine, tiny_dirs, tmp_path):
    """GPTQ-Int8 weights (group 32), MTP speculation and CUDA graphs together: the tokens equal those
    with speculation off."""
    from qv.model.quantize import quantize_checkpoint

    _, paths = setup
    quantized = tmp_path / "gptq-mtp"
    quantize_checkpoint(tiny_dirs("tiny", mtp=True), quantized, bits=8, group_size=32)
    reqs = {f"{n}-{i}": (ids, n) for n in [None, *paths] for i, ids in enumerate(PROMPTS)}
    levers = dict(device="cuda", dtype="float32", kernels="triton", max_model_len=1024)  # fp32: no ties from rounding
    want = _run(_engine(tiny_engine, quantized, paths, spec="off", **levers), reqs)
    got = _run(_engine(tiny_engine, quantized, paths, spec="mtp", spec_k=2, **levers), reqs)
    assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in want.items()}
