"""The command line: make-tiny, quantize and generate run end to end."""

from __future__ import annotations

import json
import subprocess
import sys


def _qv(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "qv.cli", *args], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_make_tiny_quantize_generate(tmp_path):
    tiny = tmp_path / "tiny"
    assert _qv("make-tiny", str(tiny), "--preset", "gqa3").strip() == str(tiny)
    quant = tmp_path / "gptq"
    _qv("quantize", str(tiny), str(quant), "--group-size", "16")
    assert json.loads((quant / "config.json").read_text())["quantization_config"]["bits"] == 8
    text = _qv("generate", "Hello", "--model", str(quant), "--max-tokens", "4")
    assert text.strip() != ""


def test_bad_lever_flag_is_a_clear_error(tmp_path):
    out = subprocess.run([sys.executable, "-m", "qv.cli", "generate", "hi", "--kv-dtype", "int4"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "kv_dtype" in out.stderr
