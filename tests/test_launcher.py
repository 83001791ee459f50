"""`qv serve` as an operator starts it: a levers file (`--env-file`), `--dry-run` (the levers, where each
came from, and the memory plan, with no weight read), refusals before loading (a busy port, a plan the
memory cannot hold: one line, exit 2), and the state directory that holds the compiled-kernel caches and
the embedded tiny model. The dry run's plan is checked against the plan a real start makes."""

from __future__ import annotations

import importlib.util
import os
import re
import socket
import subprocess
import sys
import textwrap
import time

from pathlib import Path

import httpx
import pytest

import qv
from qv.cli import main
from qv.config import EngineConfig
from qv.engine.preflight import preflight


def _bare(tmp_path, tiny_dirs, preset="gqa3"):
    """A folder with a config.json and nothing else: a start that read weights would fail on it."""
    bare = tmp_path / f"bare-{preset}"
    bare.mkdir()
    (bare / "config.json").write_text((tiny_dirs(preset) / "config.json").read_text())
    return bare


def _plans(**levers):
    from qv import LLM

    cfg = EngineConfig(**levers)
    return preflight(cfg, check_port=False).plan, LLM(**levers).engine.memory_plan


CASES = {"tiny (vision tower)": lambda t, q: dict(),
         "gptq": lambda t, q: dict(model=str(q)),
         "mtp + int8 KV": lambda t, q: dict(model=str(t("tiny", mtp=True)), spec="mtp", kv_dtype="int8"),
         "no prefix cache, kv bytes": lambda t, q: dict(model=str(t("gqa1")), prefix_caching=False,
                                                        kv_cache_bytes=3 << 20, max_num_seqs=5)}


@pytest.fixture(scope="module")
def gptq_dir(tmp_path_factory):
    from qv.model.quantize import quantize_checkpoint
    from qv.model.tiny import make_tiny

    root = tmp_path_factory.mktemp("pre")
    quantize_checkpoint(make_tiny(root / "t4", "gqa3"), root / "q4", bits=4, group_size=16, sym=False)
    return quantize_checkpoint(make_tiny(root / "t", "gqa3"), root / "q", bits=8, group_size=16, sym=True)


@pytest.mark.parametrize("case", sorted(CASES))
def test_dry_run_plan_is_the_starts_plan(case, tiny_dirs, gptq_dir):
    """Every figure of the plan is the real start's; the weights, counted from shapes, within 1%."""
    planned, real = _plans(device="cpu", **CASES[case](tiny_dirs, gptq_dir))
    assert {k: v for k, v in vars(planned).items() if k != "weight_bytes"} == \
        {k: v for k, v in vars(real).items() if k != "weight_bytes"}
    assert abs(planned.weight_bytes - real.weight_bytes) <= 0.01 * real.weight_bytes


def test_planned_device_memory_on_the_cpu(gptq_dir):
    """device_memory_bytes on the CPU: the start plans as on a GPU of that size, its loaded weights held there;
    the dry run's plan is the start's but for the weights, counted from shapes (within 1%), and what the
    KV blocks get of the rest. A 4-bit checkpoint (two codes a byte)."""
    planned, real = _plans(model=str(gptq_dir.parent / "q4"), device="cpu", device_memory_bytes=40 << 20,
                           max_num_seqs=3)
    assert real.device_bytes == planned.device_bytes == 40 << 20 and real.utilization == 0.9
    assert abs(planned.weight_bytes - real.weight_bytes) <= 0.01 * real.weight_bytes
    assert abs(planned.kv_blocks - real.kv_blocks) <= 0.01 * real.kv_blocks
    # everything of the 36 MiB share is planned: weights, blocks, states, other reserves (the prompt attention's
    # workspace), the activation reserve
    assert real.other_bytes > 0
    used = real.weight_bytes + real.kv_bytes + real.gdn_bytes + real.snapshot_bytes + real.other_bytes + real.reserve_bytes
    assert 0.99 * (0.9 * (40 << 20)) <= used <= 0.9 * (40 << 20)


@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="the Clef fixtures write adapters with peft")
def test_dry_run_plan_counts_clef(tmp_path):
    from clef.fixtures import make_clef_adapters

    folder = make_clef_adapters(tmp_path / "clef", "mixed", seed=5)
    planned, real = _plans(model=str(folder), device="cpu", clef_slots=3)
    assert planned.other_bytes == real.other_bytes > 0  # the record states of 3 slots
    assert abs(planned.weight_bytes - real.weight_bytes) <= 0.01 * real.weight_bytes


def test_dry_run_prints_levers_and_plan_and_reads_no_weight(tmp_path, tiny_dirs, capsys, monkeypatch):
    bare = _bare(tmp_path, tiny_dirs)
    levers = tmp_path / "prod.env"
    levers.write_text("# prod\nexport QV_MAX_NUM_SEQS=8\nQV_API_KEY='sekret'\nQV_BLOCK_SIZE=32\n")
    monkeypatch.setenv("QV_SPEC_K", "5")
    monkeypatch.setenv("QV_BLOCK_SIZE", "8")  # the file wins over the environment, the flag over both
    assert main(["serve", str(bare), "--env-file", str(levers), "--dry-run", "--device", "cpu", "--port", "0",
                 "--max-num-seqs", "6", "--state-dir", str(tmp_path / "state")]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert re.fullmatch(r"  max_num_seqs +6   <- flag", lines["max_num_seqs"])
    assert re.fullmatch(rf"  block_size +32   <- QV_BLOCK_SIZE in {levers}:4", lines["block_size"])
    assert re.fullmatch(r"  spec_k +5   <- QV_SPEC_K in the environment", lines["spec_k"])
    assert re.fullmatch(rf"  api_key +\*\*\*   <- QV_API_KEY in {levers}:3", lines["api_key"])
    assert re.fullmatch(r"  kv_dtype +'auto'", lines["kv_dtype"]) and "sekret" not in out
    assert f"model folder: {bare}\n" in out and f"state dir: {tmp_path / 'state'} (TRITON_CACHE_DIR=" in out
    plan = preflight(EngineConfig(model=str(bare), device="cpu", max_num_seqs=6, block_size=32, spec_k=5)).plan
    assert plan.summary() + " (weights counted from the config)" in out
    assert "checks: port 0 on 127.0.0.1 is free, the plan fits" in out
    assert not (tmp_path / "state").exists()  # a dry run writes nothing


def _refused(argv, capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_busy_port_is_refused_before_loading(tmp_path, tiny_dirs, capsys):
    """On a folder without weights a start that loaded first would fail on them; the port is named instead."""
    bare = _bare(tmp_path, tiny_dirs)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        err = _refused(["serve", str(bare), "--device", "cpu", "--port", str(port)], capsys)
        assert err == (f"qv serve: error: port {port} on 127.0.0.1 is in use (another server?): choose another "
                       "with --port or QV_PORT")
        assert main(["serve", str(bare), "--device", "cpu", "--port", str(port), "--dry-run"]) == 2
        out, err = capsys.readouterr()
        assert f"a start would be refused: port {port} on 127.0.0.1 is in use" in out and "is in use" in err


def test_too_little_memory_is_refused_before_loading(tmp_path, tiny_dirs, capsys):
    bare = _bare(tmp_path, tiny_dirs)
    err = _refused(["serve", str(bare), "--device", "cpu", "--port", "0", "--kv-cache-bytes", str(1 << 50)], capsys)
    assert err.startswith("qv serve: error: too little host memory: the plan needs ") and "available on the host" in err


def test_bad_levers_file_is_one_line(tmp_path, capsys):
    levers = tmp_path / "l.env"
    levers.write_text("QV_PORT=8001\nQV_MAX_NUM_SEQ=4\n")
    err = _refused(["serve", "--env-file", str(levers), "--dry-run"], capsys)
    assert err == f"qv serve: error: {levers}:2: QV_MAX_NUM_SEQ is no qv lever (did you mean QV_MAX_NUM_SEQS?); " \
                  "see docs/LEVERS.md"


KERNEL = '''
import sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from qv import LLM

llm = LLM(model=None, device="cpu", state_dir=sys.argv[1], max_model_len=64)  # the embedded tiny model


@triton.jit
def double(x_ptr, n, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    tl.store(x_ptr + o, tl.load(x_ptr + o, mask=o < n) * 2, mask=o < n)


# a real compile (for sm_80: Triton compiles without a GPU), after the engine started
src = ASTSource(fn=double, signature={"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}, constexprs={"BLOCK": 64})
triton.compile(src, target=GPUTarget("cuda", 80, 32))
import os
print(os.environ["CUPY_CACHE_DIR"])
'''


def test_state_dir_holds_kernel_caches_and_the_tiny_model(tmp_path):
    script = tmp_path / "start.py"
    script.write_text(textwrap.dedent(KERNEL))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("QV_", "TRITON_", "CUPY_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(qv.__file__).parents[1]), env.get("PYTHONPATH", "")])
    state = tmp_path / "state"
    out = subprocess.run([sys.executable, str(script), str(state)], capture_output=True, text=True, timeout=300,
                         env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == str(state / "cupy")
    from qv.model.tiny import EMBEDDED_BUILD

    assert (state / f"tiny-{qv.__version__}-{EMBEDDED_BUILD}" / "config.json").is_file()
    assert [p.name for p in (state / "triton").rglob("double.cubin")] == ["double.cubin"]


def test_serve_with_env_file(tmp_path):
    """The levers of a file reach the running server: its port (0: any), key and context length."""
    levers = tmp_path / "serve.env"
    levers.write_text('QV_PORT=0\nQV_API_KEY="k-1"\nQV_MAX_MODEL_LEN=512\nQV_SERVED_MODEL_NAME=from-file\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("QV_")}
    env.update(HOME=str(tmp_path), PYTHONUNBUFFERED="1", QV_API_KEY="from-the-environment")
    proc = subprocess.Popen([sys.executable, "-m", "qv.cli", "serve", "--env-file", str(levers)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines, url, deadline = [], None, time.time() + 240
        while url is None:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "qv serve exited:\n" + "".join(lines)
            assert time.time() < deadline, "".join(lines)
            lines.append(line)
            m = re.match(r"qv: serving model '([^']+)' at (http://[\d.]+:\d+)/v1", line)
            if m:
                assert m.group(1) == "from-file"
                url = m.group(2)
        assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer from-the-environment"}).status_code == 401
        models = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer k-1"})
        assert models.status_code == 200 and models.json()["data"][0]["max_model_len"] == 512
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.mark.gpu
def test_gpu_refusal_and_dry_run(tmp_path, tiny_dirs, capsys):
    """On the GPU: a plan past the free memory is refused before loading; the dry run's plan is the start's."""
    import torch

    free, total = torch.cuda.mem_get_info()
    bare = _bare(tmp_path, tiny_dirs)
    err = _refused(["serve", str(bare), "--device", "cuda", "--port", "0", "--kv-cache-bytes", str(total)], capsys)
    assert err.startswith("qv serve: error: too little free GPU memory: the plan needs ")
    err = _refused(["serve", str(bare), "--device", "cuda", "--port", "0", "--gpu-memory-utilization", "0.00000001"],
                   capsys)
    assert "too little free GPU memory: the weights need" in err or "no memory left for the KV cache" in err
    assert main(["serve", "--device", "cuda", "--port", "0", "--dry-run"]) == 0
    assert "free on the GPU" in capsys.readouterr().out
    planned, real = _plans(device="cuda", cuda_graphs=False)
    assert planned.gdn_slots == real.gdn_slots  # the snapshots and blocks share what the weights leave
    assert abs(planned.snapshots - real.snapshots) <= 0.02 * real.snapshots
    assert abs(planned.kv_blocks - real.kv_blocks) <= 0.02 * real.kv_blocks  # weights estimated, allocator slack


START = """
import sys, time
t = time.perf_counter()
from qv import LLM, SamplingParams
llm = LLM(model=None, device="cuda", state_dir=sys.argv[1], max_model_len=256)
llm.generate(["hello there"], SamplingParams(max_tokens=8, temperature=0))
print(f"{time.perf_counter() - t:.2f}")
"""


@pytest.mark.gpu
def test_second_start_reuses_compiled_kernels(tmp_path):
    """Two starts on one state dir: the first fills Triton's (and with CuPy, CuPy's) cache there, the second
    compiles nothing new. Both start times are printed (run with -s to record them)."""
    script = tmp_path / "start.py"
    script.write_text(START)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("QV_", "TRITON_", "CUPY_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(qv.__file__).parents[1]), env.get("PYTHONPATH", "")])
    state = tmp_path / "state"
    times, files = [], []
    for _ in range(2):
        out = subprocess.run([sys.executable, str(script), str(state)], capture_output=True, text=True, timeout=600,
                             env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        times.append(float(out.stdout.split()[-1]))
        files.append(sorted(str(p.relative_to(state)) for p in state.rglob("*") if p.is_file()))
    cupy = sum(f.startswith("cupy/") for f in files[0])  # the tiny model may run no raw-CUDA kernel
    print(f"\nstart + 8 tokens: cold state dir {times[0]:.1f} s, warm {times[1]:.1f} s; {cupy} CuPy cache files")
    assert any(f.startswith("triton/") for f in files[0]) and files[1] == files[0]
