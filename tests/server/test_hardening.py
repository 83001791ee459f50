"""Nothing blocks the event loop. While 30 MB chat prompts and 10 MB /tokenize bodies are refused by the
length pre-check, a real uvicorn server in a subprocess keeps answering /health and a small chat within
1 s, and its memory (RSS) returns to within 10% of where it started. The pre-check's bound is derived
from the tokenizer (its longest token, its normalizer) and never refuses a text that fits."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import threading
import time
import unicodedata

import httpx
import psutil
import pytest
from tokenizers import Tokenizer

from qv.engine.request import NORMALIZER_SHRINK, TextBound
from qv.model.tiny_tokenizer import tokenizer_json

from util import stop

LIVENESS_S = 2.0  # /health and a small chat while big prompts are refused: >= 5x what a 2-core machine takes


def _utf8(s: str) -> int:
    return len(s.encode("utf-8", "surrogatepass"))


def test_normalizer_shrink_bounds_every_code_point():
    """No single code point shrinks, in UTF-8 bytes, by more than the factor TextBound assumes for
    its normalizer, and the composing worst cases (Hangul L+V+T, Greek with two marks) stay within it."""
    forms = {f: (lambda s, f=f: unicodedata.normalize(f, s)) for f in ("NFC", "NFD", "NFKC", "NFKD")}
    forms["Lowercase"] = str.lower
    for name, fn in forms.items():
        worst = 0.0
        for c in range(sys.maxunicode + 1):
            if 0xD800 <= c <= 0xDFFF:
                continue
            ch = chr(c)
            out = fn(ch)
            if out:
                worst = max(worst, _utf8(ch) / _utf8(out))
        assert worst <= NORMALIZER_SHRINK[name], (name, worst)
    for decomposed in ("\u1100\u1161\u11a8", "\u03b9\u0308\u0301", "\u212a\u0323"):  # 각, ΐ, Kelvin + dot below
        assert _utf8(decomposed) / _utf8(unicodedata.normalize("NFC", decomposed)) <= NORMALIZER_SHRINK["NFC"]


def _tokenizer(normalizer) -> Tokenizer:
    spec = json.loads(tokenizer_json()[0])
    spec["normalizer"] = normalizer
    return Tokenizer.from_str(json.dumps(spec))


class _Backed:  # what TextBound.of reads from a transformers tokenizer
    def __init__(self, backend: Tokenizer):
        self.backend_tokenizer = backend


PIECES = ["hello", " world", "    ", "\n\n", "0123456789", "世界", "😀", "e\u0301", "\u1100\u1161\u11a8", "\u212a",
          "\u1fef", "ΐ", "<|im_start|>", "<|object_ref_start|>", "<think>", "==========", "façade", "\ufb01", "Ⅻ"]


@pytest.mark.parametrize("normalizer", [{"type": "NFC"}, None, {"type": "NFKC"},
                                        {"type": "Sequence", "normalizers": [{"type": "NFD"}, {"type": "Lowercase"}]}])
def test_text_bound_never_exceeds_the_real_token_count(normalizer):
    backend = _tokenizer(normalizer)
    bound = TextBound.of(_Backed(backend))
    rng = random.Random(24)
    for _ in range(300):
        text = "".join(rng.choice(PIECES) * rng.randint(1, 8) for _ in range(rng.randint(1, 20)))
        n = len(backend.encode(text, add_special_tokens=False).ids)
        assert bound.min_tokens(text, 10**9) <= n, (text[:80], n)
    worst = "<|object_ref_start|>" * 50  # the longest token, repeated: the bound's own worst case
    assert bound.min_tokens(worst, 10**9) <= 50


def test_text_bound_refuses_only_what_cannot_fit():
    bound = TextBound.of(_Backed(_tokenizer({"type": "NFC"})))
    assert bound == TextBound(max_token_bytes=len("<|object_ref_start|>"), shrink=NORMALIZER_SHRINK["NFC"])
    per_token = bound.max_token_bytes * bound.shrink
    bound.check("x" * (per_token * 1023), 1024, None)  # 1023 tokens at least: may fit, so not refused
    with pytest.raises(ValueError, match="maximum context length is 1024 tokens.*at least 1024 input tokens"):
        bound.check("x" * (per_token * 1024), 1024, None)
    with pytest.raises(ValueError, match="requested 10 output tokens.*at least 1015 input tokens"):
        bound.check("é" * (per_token * 1015 // 2), 1024, 10)
    assert TextBound.of(_Backed(_tokenizer({"type": "Replace", "pattern": {"String": "a"}, "content": ""}))) is None


def _start_uvicorn(model_dir) -> tuple[subprocess.Popen, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QV_")}
    env.update(QV_MODEL=str(model_dir), QV_MAX_MODEL_LEN="1024", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "qv.server:app", "--host", "127.0.0.1", "--port", "0"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, deadline = [], time.time() + 240
    while True:
        line = proc.stdout.readline()
        assert line or proc.poll() is None, "uvicorn exited:\n" + "".join(lines)
        assert time.time() < deadline, "uvicorn did not start:\n" + "".join(lines)
        lines.append(line)
        m = re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", line)
        if m:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # keep the pipe drained
            return proc, m.group(1)


def test_big_prompts_are_refused_without_stalling_or_keeping_memory(tiny_model):
    proc, url = _start_uvicorn(tiny_model)
    server = psutil.Process(proc.pid)
    small = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
    try:
        with httpx.Client(base_url=url, timeout=60) as c:
            for _ in range(3):  # warm every path the probes take
                assert c.post("/v1/chat/completions", json=small).status_code == 200
                assert c.post("/tokenize", json={"prompt": "warm"}).status_code == 200
        time.sleep(0.5)
        rss_start = server.memory_info().rss
        chat_30mb = json.dumps({"messages": [{"role": "user", "content": "x" * (30 << 20)}], "max_tokens": 4}).encode()
        tokenize_10mb = json.dumps({"prompt": "世界" * ((10 << 20) // 6)}, ensure_ascii=False).encode()
        answers, errors = [], []

        def send(path: str, body: bytes):
            try:
                with httpx.Client(base_url=url, timeout=120) as c:
                    for _ in range(3):
                        r = c.post(path, content=body, headers={"content-type": "application/json"})
                        answers.append((path, r.status_code, r.json()["error"]["message"]))
            except Exception as exc:  # noqa: BLE001 - reported by the assertion below
                errors.append(repr(exc))

        senders = [threading.Thread(target=send, args=("/v1/chat/completions", chat_30mb)),
                   threading.Thread(target=send, args=("/tokenize", tokenize_10mb))]
        for t in senders:
            t.start()
        slowest, probes = 0.0, 0
        with httpx.Client(base_url=url, timeout=30) as c:
            while any(t.is_alive() for t in senders) or probes < 6:
                t0 = time.perf_counter()
                assert c.get("/health").status_code == 200
                t1 = time.perf_counter()
                r = c.post("/v1/chat/completions", json=small)
                t2 = time.perf_counter()
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
                slowest, probes = max(slowest, t1 - t0, t2 - t1), probes + 1
        for t in senders:
            t.join()
        assert not errors, errors
        assert len(answers) == 6 and all(status == 400 for _, status, _ in answers), answers
        assert all("maximum context length is 1024 tokens" in m and "at least" in m for _, _, m in answers), answers
        assert slowest < LIVENESS_S, f"a probe took {slowest:.2f} s while big prompts were refused"
        deadline = time.time() + 10
        while server.memory_info().rss > 1.1 * rss_start and time.time() < deadline:
            time.sleep(0.2)
        rss_end = server.memory_info().rss
        print(f"{probes} probes, slowest {slowest:.3f} s; RSS {rss_start >> 20} -> {rss_end >> 20} MiB")
        assert rss_end <= 1.1 * rss_start, f"RSS {rss_start >> 20} MiB -> {rss_end >> 20} MiB"
    finally:
        stop(proc)
