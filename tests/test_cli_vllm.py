"""vLLM's command lines on `qv`: each flag qv has an equivalent of sets that lever; one it has none of is
refused saying so; an unknown flag is the subcommand's error with the nearest flag; each subcommand takes
only its own flags."""

from __future__ import annotations

import shlex

import pytest

from qv.cli import _model, _overrides, build_parser, main
from qv.config import ConfigError, EngineConfig

# a vLLM command line (after `vllm`) -> the levers it must set (model: the checkpoint folder)
VLLM_LINES = [
    ("serve /m --enable-prefix-caching", {"model": "/m", "prefix_caching": True}),
    ("serve /m --no-enable-prefix-caching", {"model": "/m", "prefix_caching": False}),
    ("serve /m --enforce-eager", {"model": "/m", "cuda_graphs": False}),
    ("serve /m --kv-cache-dtype int8", {"model": "/m", "kv_dtype": "int8"}),
    ("serve /m --kv-cache-dtype bfloat16", {"model": "/m", "kv_dtype": "bf16"}),
    ("serve /m --kv-cache-dtype auto", {"model": "/m", "kv_dtype": "auto"}),
    ("""serve /m --speculative-config '{"method": "mtp", "num_speculative_tokens": 3}'""",
     {"model": "/m", "spec": "mtp", "spec_k": 3}),
    ("""serve /m --speculative-config '{"method": "qwen3_next_mtp", "num_speculative_tokens": 2}'""",
     {"model": "/m", "spec": "mtp", "spec_k": 2}),
    ("""serve /m --speculative-config '{"method": "ngram"}'""", {"model": "/m", "spec": "ngram"}),
    ("serve /m -tp 2", {"model": "/m", "tensor_parallel_size": "2"}),
    ("serve /m --tensor-parallel-size 2", {"model": "/m", "tensor_parallel_size": "2"}),
    ("serve /m --served-model-name a b", {"model": "/m", "served_model_name": "a,b"}),
    ("serve /m --served-model-name a,b", {"model": "/m", "served_model_name": "a,b"}),
    ("serve --model /m --port 8001", {"model": "/m", "port": "8001"}),
    ("serve /m --model /m", {"model": "/m"}),
    ("serve /m --kv-cache-memory-bytes 8G", {"model": "/m", "kv_cache_bytes": 8 << 30}),
    ("serve /m --kv-cache-memory-bytes 1000000", {"model": "/m", "kv_cache_bytes": 1000000}),
    ("serve /m --kv-cache-memory-bytes 2g", {"model": "/m", "kv_cache_bytes": 2 * 10**9}),
    ("""serve /m --limit-mm-per-prompt '{"image": 4, "video": 0}'""",
     {"model": "/m", "media_max_images": 4, "media_max_videos": 0}),
    ("serve /m --limit-mm-per-prompt image=3", {"model": "/m", "media_max_images": "3"}),
    ("serve /m --uvicorn-log-level warning", {"model": "/m", "log_level": "warning"}),
    ("serve /m --disable-log-stats --disable-uvicorn-access-log", {"model": "/m", "log_stats": False,
                                                                   "access_log": "off"}),
    ("serve /m --disable-log-requests --enable-auto-tool-choice --tool-call-parser qwen3_coder "
     "--reasoning-parser qwen3", {"model": "/m"}),
    ("serve /m --max-model-len 32768 --gpu-memory-utilization 0.96 --max-num-seqs 8",
     {"model": "/m", "max_model_len": "32768", "gpu_memory_utilization": "0.96", "max_num_seqs": "8"}),
    ("serve /m --enforce-eager --cuda-graphs 1", {"model": "/m", "cuda_graphs": "1"}),  # the later one wins
    ("bench /m --enforce-eager -tp 2", {"model": "/m", "cuda_graphs": False, "tensor_parallel_size": "2"}),
    ("generate /m hello --kv-cache-dtype int8", {"model": "/m", "kv_dtype": "int8"}),
    ("generate hello --model /m", {"model": "/m"}),
]


@pytest.mark.parametrize("line, levers", VLLM_LINES, ids=[line for line, _ in VLLM_LINES])
def test_vllm_command_line_sets_the_lever(line, levers):
    args = build_parser().parse_args(shlex.split(line))
    got = {**_overrides(args), "model": _model(args)}
    assert got == levers
    EngineConfig(**got)  # every value is one the lever takes


# vLLM flags qv has no equivalent of (or values it does not take): refused with the reason
REFUSED = [
    ("serve /m --chat-template t.jinja", "has no qv equivalent: qv renders the checkpoint's own template"),
    ("serve /m --kv-cache-dtype fp8", "qv has no fp8 KV cache"),
    ("serve /m --tool-call-parser hermes", "parses Qwen3.5's tool calls ('qwen3_coder') only"),
    ("serve /m --reasoning-parser deepseek_r1", "('qwen3') only"),
    ("""serve /m --speculative-config '{"model": "draft", "num_speculative_tokens": 3}'""",
     "qv has no equivalent of model"),
    ("""serve /m --speculative-config '{"method": "eagle3"}'""", "method 'eagle3'"),
    ("serve /m --speculative-config mtp", "not JSON"),
    ("""serve /m --limit-mm-per-prompt '{"audio": 1}'""", "images and videos only, not audio"),
    ("serve /m --kv-cache-memory-bytes lots", "is not a byte count"),
    ("serve /m --prot 8000", "qv serve: error: unrecognized arguments: --prot 8000 (did you mean --port?)"),
    ("serve /m --enable-prefix-cache", "(did you mean --enable-prefix-caching?)"),
    ("bench /m --port 8001", "qv bench: error: unrecognized arguments: --port"),
    ("generate hi --api-key k", "qv generate: error: unrecognized arguments: --api-key"),
    ("bench /m --chat-template t.jinja", "qv bench: error: unrecognized arguments: --chat-template"),
]


@pytest.mark.parametrize("line, message", REFUSED, ids=[line for line, _ in REFUSED])
def test_refused_with_the_reason(line, message, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(shlex.split(line))
    err = " ".join(capsys.readouterr().err.split())
    assert e.value.code == 2 and message in err, err
    assert "usage:" not in err  # one line and a pointer to --help, not a screen of usage


def test_two_different_models_are_refused():
    args = build_parser().parse_args(["serve", "/a", "--model", "/b"])
    with pytest.raises(ConfigError, match="two models named: /a"):
        _model(args)


def test_version(capsys):
    from qv.version import __version__

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"qv {__version__}"


def test_hub_id_says_it_is_not_downloaded(capsys):
    assert main(["serve", "Qwen/Qwen3.5-0.8B", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not download from the Hugging Face Hub" in err
    assert "--local-dir /models/Qwen3.5-0.8B" in err
