"""The documented quick start works as written: `qv serve` on a fresh home directory builds the
tiny default model, prints where it listens, and answers the README's curl request (sent as written
with curl when it is installed, and always as the same JSON through httpx)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx

from util import stop

DOC = Path(__file__).resolve().parents[2] / "docs" / "QUICKSTART_SERVER.md"


def _curl_block() -> str:
    blocks = re.findall(r"```bash\n(.*?)```", DOC.read_text(), re.S)
    curls = [b for b in blocks if b.lstrip().startswith("curl ")]
    assert curls, "the quick start has a curl example"
    return curls[0]  # the first is the quick start's; later ones show other features


def _curl_parts(block: str) -> tuple[str, dict]:
    argv = shlex.split(block.replace("\\\n", " "))
    url = next(a for a in argv if a.startswith("http://"))
    body = json.loads(argv[argv.index("-d") + 1])
    return url, body


def test_import_does_not_load_the_model():
    code = ("import sys, qv.server; assert 'torch' not in sys.modules; app = qv.server.app; "
            "assert 'torch' not in sys.modules and 'qv.engine.engine' not in sys.modules; print(type(app).__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "Starlette"


def test_qv_serve_fresh_home_and_readme_curl(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("QV_")}
    env.update(HOME=str(tmp_path), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "qv.cli", "serve", "--port", "0", "--max-model-len", "512"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines, url = [], None
        deadline = time.time() + 240
        while url is None:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "qv serve exited:\n" + "".join(lines)
            assert time.time() < deadline, "qv serve did not report where it listens:\n" + "".join(lines)
            lines.append(line)
            m = re.match(r"qv: serving model '([^']+)' at (http://[\d.]+:\d+)/v1", line)
            if m:
                name, url = m.group(1), m.group(2)
        log = "".join(lines)
        assert "building the embedded tiny default model" in log  # progress shown on first start
        assert (tmp_path / ".cache" / "qv").is_dir() and name.startswith("tiny-")
        assert httpx.get(url + "/health").status_code == 200

        doc_url, body = _curl_parts(_curl_block())
        path = doc_url.split("8000", 1)[1]
        r = httpx.post(url + path, json=body, timeout=120)
        assert r.status_code == 200, r.text
        reply = r.json()
        assert reply["object"] == "chat.completion" and reply["model"] == name
        assert reply["usage"]["completion_tokens"] <= body["max_tokens"]
        assert reply["choices"][0]["message"]["content"] is not None

        curl = shutil.which("curl")
        if curl:  # the block exactly as written, with the port this server got
            block = _curl_block().replace("http://127.0.0.1:8000", url)
            out = subprocess.run(["bash", "-c", block], capture_output=True, text=True, timeout=120)
            assert out.returncode == 0, out.stderr
            assert json.loads(out.stdout)["choices"][0]["message"]["role"] == "assistant"
    finally:
        stop(proc)


def test_uvicorn_app_reads_levers_from_the_environment(tiny_dirs):
    """`uvicorn qv.server:app` builds its engine from QV_* at startup (here a model folder, a
    served name and an API key)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("QV_")}
    env.update(QV_MODEL=str(tiny_dirs("tiny")), QV_SERVED_MODEL_NAME="from-env", QV_API_KEY="k1",
               QV_MAX_MODEL_LEN="256", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "qv.server:app", "--host", "127.0.0.1", "--port", "0"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines, url = [], None
        deadline = time.time() + 240
        while url is None:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "uvicorn exited:\n" + "".join(lines)
            assert time.time() < deadline, "uvicorn did not start:\n" + "".join(lines)
            lines.append(line)
            m = re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", line)
            url = m.group(1) if m else None
        assert httpx.get(url + "/v1/models").status_code == 401
        models = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer k1"}).json()
        assert [m["id"] for m in models["data"]] == ["from-env"] and models["data"][0]["max_model_len"] == 256
    finally:
        stop(proc)
