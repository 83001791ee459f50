"""The command line: make-tiny, quantize and generate run end to end; every subcommand's --help works and
shows defaults; errors a user can act on are one line with exit status 2 (their traceback only with
--debug); `qv doctor` reports on a machine without CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from qv.cli import main
from qv.doctor import report

COMMANDS = ["serve", "generate", "bench", "make-tiny", "quantize", "kernels", "doctor"]


def _qv(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qv.cli", *args], capture_output=True, text=True, timeout=600,
                          env=env)


def _ok(*args: str) -> str:
    out = _qv(*args)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_make_tiny_quantize_generate(tmp_path):
    tiny = tmp_path / "tiny"
    assert _ok("make-tiny", str(tiny), "--preset", "gqa3").strip() == str(tiny)
    quant = tmp_path / "gptq"
    _ok("quantize", str(tiny), str(quant), "--group-size", "16", "--num-samples", "4", "--seq-len", "32")  # gptq
    assert json.loads((quant / "config.json").read_text())["quantization_config"]["bits"] == 8
    text = _ok("generate", "Hello", "--model", str(quant), "--max-tokens", "4")
    assert text.strip() != ""


@pytest.mark.parametrize("command", [None] + COMMANDS)
def test_help_of_every_command(command, capsys):
    with pytest.raises(SystemExit) as e:
        main(([command] if command else []) + ["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith(f"usage: qv {command or ''}".rstrip())
    assert "--debug" in out
    flat = " ".join(out.split())  # argparse wraps at the terminal width
    shows = {"serve": ["(env QV_MAX_NUM_SEQS, default 64)", "--env-file FILE", "--dry-run", "then these flags"],
             "generate": ["(default: 32)", "(env QV_KV_DTYPE, default 'auto')"],
             "bench": ["(default: 1,8,16,32,64)", "(default: 1024)"],
             "make-tiny": ["(default: tiny)", "(default: 16)"], "quantize": ["(default: 128)", "(default: 8)"],
             "kernels": ["--arch ARCH", "(default: sm_70)", "--out DIR"],
             None: COMMANDS}
    for needle in shows.get(command, []):
        assert needle in flat, (needle, out)


def test_lever_flag_help_says_what_it_takes(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--kv-dtype {auto,fp16,bf16,int8}" in out and "--cuda-graphs {1,0}" in out
    assert "Takes a number > 0 and <= 1. (env QV_GPU_MEMORY_UTILIZATION, default 0.9)" in out


def test_bad_lever_flag_is_one_line_with_status_2():
    out = _qv("generate", "hi", "--kv-dtype", "int4")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == ["qv generate: error: kv_dtype='int4': expected one of auto, fp16, bf16, int8"]
    debug = _qv("generate", "hi", "--kv-dtype", "int4", "--debug")
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "ConfigError" in debug.stderr


def test_engine_that_cannot_start_is_one_line(tmp_path, tiny_dirs):
    """Past the checks before loading, `qv serve` on a folder without weights stops with the loader's message."""
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((tiny_dirs("gqa3") / "config.json").read_text())
    out = _qv("serve", str(bare), "--device", "cpu", "--port", "0")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1] == f"qv serve: error: no *.safetensors files in {bare}"


def test_user_errors_are_one_line(tmp_path, tiny_dirs, capsys):
    """ConfigError (no such folder), CheckpointError (a config without weights): exit 2, the message alone;
    --debug (before or after the command) raises the exception itself."""
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((tiny_dirs("gqa3") / "config.json").read_text())
    cases = [(["generate", "hi", "--model", str(tmp_path / "nope")], "does not exist"),
             (["generate", "hi", "--model", str(bare), "--device", "cpu"], "no *.safetensors files"),
             (["serve", str(tmp_path / "nope"), "--dry-run"], "does not exist"),
             (["make-tiny", str(tmp_path / "t"), "--preset", "no-such"], "unknown preset 'no-such': choose from tiny")]
    for argv, needle in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and needle in err and err.startswith(f"qv {argv[0]}: error: ")
        for debug in ([argv[0], "--debug", *argv[1:]], ["--debug", *argv]):
            with pytest.raises(Exception, match=needle.replace("*", r"\*")):
                main(debug)


def test_doctor_on_this_machine():
    env = {k: v for k, v in os.environ.items() if not k.startswith("QV_")}
    env["CUDA_VISIBLE_DEVICES"] = ""  # as a machine without CUDA sees it, whatever this one has
    out = _qv("doctor", env=env)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for needle in ("qv 0.1.0 on Python", "packages:", "torch ", "devices:", "CUDA: no device available",
                   "toolchain:", "Triton ", "NVRTC", "kernels (which implementations run):",
                   "cpu: kernels=auto runs reference", "state dir", "TRITON_CACHE_DIR=", "CUPY_CACHE_DIR=",
                   "none set (every lever at its default)"):
        assert needle in text, (needle, text)
    assert "error" not in text


def test_doctor_reports_bad_levers_instead_of_crashing(tmp_path):
    text = report({"QV_KERNELS": "bogus", "QV_PORT": "1"})
    assert "error: kernels='bogus' (from QV_KERNELS in the environment): expected one of" in text
    assert "cpu: kernels=auto runs reference" in text  # the rest of the report still prints
    text = report({"QV_KERNELS": "reference", "QV_API_KEY": "sekret", "QV_STATE_DIR": str(tmp_path)})
    assert "QV_KERNELS='reference'" in text and "QV_API_KEY='***'" in text and "sekret" not in text
    assert f"state dir {tmp_path}\n" in text


def test_doctor_says_a_cuda_torch_on_a_machine_without_gpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    text = report({})
    assert "built for CUDA 13.0" in text and "CUDA: no device available" in text
    assert "this torch is a CUDA 13.0 build" in text and "--index-url https://download.pytorch.org/whl/cpu" in text
    monkeypatch.setattr(torch.version, "cuda", None)  # a CPU build: nothing to say
    assert "this torch is a CUDA" not in report({})


def test_malformed_config_or_checkpoint_file_is_one_line(tmp_path, tiny_dirs, capsys):
    """A config.json that is not JSON (or not an object) and a truncated safetensors file: one line naming the
    file and the problem, exit status 2."""
    import shutil

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "qwen3_5",\n  "vocab_size": }')
    (tmp_path / "listed").mkdir()
    (tmp_path / "listed" / "config.json").write_text("[1, 2]")
    truncated = tmp_path / "truncated"
    shutil.copytree(tiny_dirs("tiny"), truncated)
    weights = next(truncated.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    cases = [(["serve", str(broken), "--dry-run"], f"{broken / 'config.json'} is not valid JSON: Expecting value at "
                                                   "line 2 column 17"),
             (["generate", str(broken), "hi"], f"{broken / 'config.json'} is not valid JSON"),
             (["serve", str(tmp_path / "listed"), "--dry-run"], "config.json is not a JSON object (it holds a list)"),
             (["generate", str(truncated), "hi", "--device", "cpu"], f"cannot read safetensors file {weights}")]
    for argv, needle in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and needle in err, err


def test_prod_env_is_accepted(tmp_path, capsys):
    """configs/prod.env (the README's operator example) is a valid levers file: a dry run on a config-only
    folder accepts every key and shows where each value came from."""
    from pathlib import Path

    from qv.bench.presets import write_preset

    prod = Path(__file__).resolve().parents[1] / "configs" / "prod.env"
    assert "--env-file configs/prod.env" in (prod.parents[1] / "README.md").read_text()
    folder = write_preset("0.5b", tmp_path / "cfg")
    assert main(["serve", str(folder), "--env-file", str(prod), "--dry-run", "--port", "0"]) == 0
    out = capsys.readouterr().out
    for line in ("tensor_parallel_size         2", "kv_dtype                     'int8'",
                 "max_model_len                262144", "clef_nmax                    34816"):
        assert f"{line}   <- " in out and "prod.env:" in out.split(line)[1].splitlines()[0], line
    assert "checks: port 0 on 0.0.0.0 is free, the plan fits" in out
