"""The TypeSafe SDK (`typesafe-sdk` on PyPI), unmodified, against a real `qv serve` on the embedded
default model (a fresh home directory, so the server builds it, Clef head included): text and
JSON states with every question type under the SDK's default model `jev-latest`, images as assets
with `<image:...>` placeholders (the SDK's multipart form, zstd-compressed as the SDK sends it, and
plain), its error mapping and `models.list()`. Every answer equals the offline API's
(`LLM.decide`) on the same folder for the same record. Also the README's /v1/systemone curl,
exactly as written."""

from __future__ import annotations

import base64
import io
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
import pytest

from util import stop

ts = pytest.importorskip("typesafe_sdk", reason="the SDK test needs typesafe-sdk (test extra)")

ROOT = Path(__file__).resolve().parents[2]
MAX_MODEL_LEN = 4096


@pytest.fixture(scope="module")
def qv_serve(tmp_path_factory):
    """`qv serve` with no model on a fresh home: (base URL, the embedded model's folder)."""
    home = tmp_path_factory.mktemp("home")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("QV_", "TYPESAFE_"))}
    env.update(HOME=str(home), PYTHONUNBUFFERED="1")
    log = home / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "qv.cli", "serve", "--port", "0", "--max-model-len",
                                 str(MAX_MODEL_LEN)], env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        deadline, url = time.time() + 300, None
        while url is None:
            assert proc.poll() is None, "qv serve exited:\n" + log.read_text()
            assert time.time() < deadline, "qv serve did not report where it listens:\n" + log.read_text()
            m = re.search(r"qv: serving model '([^']+)' at (http://[\d.]+:\d+)/v1", log.read_text())
            url = m.group(2) if m else time.sleep(0.2)
        folders = list((home / ".cache" / "qv").iterdir())
        assert len(folders) == 1 and (folders[0] / "joint_head.safetensors").is_file(), folders
        yield url, folders[0]
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def offline(qv_serve):
    from qv import LLM

    return LLM(str(qv_serve[1]), max_model_len=MAX_MODEL_LEN)


def client(url: str, **kw):
    return ts.TypeSafeClient(api_key="unused", base_url=url, retry=ts.RetryPolicy(max_retries=0), timeout=120, **kw)


def png(seed: int, h: int, w: int) -> bytes:
    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


QUESTIONS = {
    "billing": {"type": "noul", "instructions": "Is this about billing?"},
    "tone": {"type": "choice", "instructions": "What is the tone?", "criteria": {"calm": None, "angry": "upset"}},
    "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["Can wait", "This week", "Today"]},
}


def sdk_questions():
    return {"billing": ts.Noul(instructions="Is this about billing?"),
            "tone": ts.Choice(instructions="What is the tone?", criteria={"calm": None, "angry": "upset"}),
            "urgency": ts.Score(instructions="How urgent?", criteria=["Can wait", "This week", "Today"])}


@pytest.mark.parametrize("state", ["I was charged twice. Please help.",
                                   {"message": "I was charged twice.", "order": {"id": 7, "items": ["a", "b"]}}])
def test_text_and_json_states(qv_serve, offline, state):
    url, _ = qv_serve
    with client(url) as c:
        result = c.system_one(state=state, questions=sdk_questions())
    assert result.model == "jev-latest"  # the SDK's default model, answered as Clef
    assert set(result.nouls) == {"billing"} and set(result.choices) == {"tone"} and set(result.scores) == {"urgency"}
    assert result.choices["tone"].choice in {"calm", "angry"} and 0 <= result.nouls["billing"].noul <= 1
    assert sorted(result.scores["urgency"].probabilities) == [0, 1, 2]  # the SDK reads the levels as ints
    ref = offline.decide({"model": "jev-latest", "state": state, "questions": QUESTIONS})
    assert result.raw_http_response.json() == ref
    assert result.usage.input_tokens == ref["usage"]["input_tokens"] and result.usage.output_tokens == 0


@pytest.mark.parametrize("compression", [None, False], ids=["zstd", "plain"])
def test_images_as_assets_with_placeholders(qv_serve, offline, compression):
    """One image passed in `assets` under the caller's own placeholder and used in an instruction,
    one attached and placed in the state by its reference: the SDK sends a multipart body (zstd
    when it compresses); the record reads "[image 1]" and "[image 2]" where the placeholders were."""
    from typesafe_sdk._core.compression import COMPRESSORS

    url, _ = qv_serve
    assert compression is False or "zstd" in COMPRESSORS  # the SDK compresses: test extra typesafe-sdk[zstd]
    first, second = png(31, 40, 56), png(32, 64, 48)
    photo = ts.Image(second)
    questions = dict(sdk_questions(), same={"type": "noul", "instructions": "Does <image:mine> show the same?"})
    with client(url, compression=compression) as c, c.attach_assets(photo):
        result = c.system_one(state=f"Customer photo: {photo}", questions=questions,
                              assets={"<image:mine>": ts.Image(first)}, model="clef")
    b64 = lambda data: base64.b64encode(data).decode()  # noqa: E731
    ref = offline.decide({"model": "clef", "state": "Customer photo: <image:theirs>",
                          "questions": dict(QUESTIONS, same=questions["same"]),
                          "assets": {"<image:mine>": {"data_base64": b64(first)}, "<image:theirs>": {"data_base64": b64(second)}}})
    assert result.raw_http_response.json() == ref
    text_only = offline.decide({"model": "clef", "state": "Customer photo: [image 2]",
                                "questions": dict(QUESTIONS, same=questions["same"])})
    assert ref["usage"]["input_tokens"] > text_only["usage"]["input_tokens"] + 6  # both images count as input
    assert ref["answers"] != text_only["answers"]


def test_state_that_is_an_image(qv_serve, offline):
    url, _ = qv_serve
    data = png(33, 50, 50)
    with client(url) as c:
        result = c.system_one(state=ts.Image(data), questions={"billing": ts.Noul(instructions="Is this about billing?")})
    ref = offline.decide({"model": "jev-latest", "state": "<image:x>", "questions": {"billing": QUESTIONS["billing"]},
                          "assets": {"<image:x>": {"data_base64": base64.b64encode(data).decode()}}})
    assert result.raw_http_response.json() == ref


def test_sdk_errors_and_models(qv_serve):
    url, _ = qv_serve
    with client(url) as c:
        with pytest.raises(ts.TypeSafeNotFoundError, match="The model `gpt-4` does not exist"):
            c.system_one(state="x", questions=sdk_questions(), model="gpt-4")
        with pytest.raises(ts.TypeSafeBadRequestError, match="'max_length' must be a positive integer"):
            c.system_one(state="x", questions=sdk_questions(), extra_body={"max_length": 0})
        with pytest.raises(ts.TypeSafeBadRequestError, match="unknown type 'box'"):
            c.system_one(state="x", questions={"where": ts.Box(instructions="Find the logo")})
        names = [m.name for m in c.models.list().models]
    assert names[0].startswith("tiny-") and names[1:] == ["clef", "jev-latest"]


def _readme_systemone_curl() -> str:
    section = (ROOT / "README.md").read_text().split("### Decisions (Clef)", 1)[1].split("\n## ", 1)[0]
    blocks = [b for b in re.findall(r"```bash\n(.*?)```", section, re.S) if "/v1/systemone" in b]
    assert len(blocks) == 1, "README's Clef section has one /v1/systemone curl"
    return blocks[0]


def test_readme_curl_as_written(qv_serve):
    url, _ = qv_serve
    block = _readme_systemone_curl()
    argv = shlex.split(block.replace("\\\n", " "))
    body = json.loads(argv[argv.index("-d") + 1])
    r = httpx.post(url + "/v1/systemone", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert list(r.json()["answers"]) == list(body["questions"]) and r.json()["model"] == body["model"]
    if shutil.which("curl"):  # the block exactly as written, with the port this server got
        out = subprocess.run(["bash", "-c", block.replace("http://127.0.0.1:8000", url)], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout) == r.json()
