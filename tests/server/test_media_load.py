"""Media work never stalls the server: while requests of twenty 8000x8000 PNGs (5 MB bodies within
every byte limit) are being refused by their headers, and a request of two large images within
the pixel budget is being decoded and preprocessed in the decode pool, /health and a small chat
keep answering within 1 s, and the process's memory returns to within 10% of where it started.

The server is the real one (uvicorn in a thread of this process, the tiny model through the real
engine), so RSS is this process's; the request bodies are built before the baseline."""

from __future__ import annotations

import base64
import gc
import json
import threading
import time

import httpx
from media_files import blank_png

BOMBS, ROUNDS = 3, 2  # concurrent senders of the twenty-image body, bodies each


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def chat_body(urls: list[str], text: str = "Describe.", max_tokens: int = 2) -> bytes:
    content = [{"type": "text", "text": text}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                       "temperature": 0}).encode()


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def test_health_and_chat_answer_while_media_is_refused_and_decoded(server):
    twenty = chat_body([data_url(blank_png(8000, 8000))] * 20)
    assert 4_500_000 < len(twenty) < 5_500_000
    two = chat_body([data_url(blank_png(4000, 3000))] * 2)  # 24M pixels: decoded and preprocessed
    small = chat_body([], "hi")
    url = server.v1 + "/chat/completions"
    headers = {"content-type": "application/json"}
    with httpx.Client(timeout=120) as c:  # warm every path once, so the baseline includes their imports
        assert c.post(url, content=twenty, headers=headers).status_code == 400
        assert c.post(url, content=two, headers=headers).status_code == 200
        assert c.post(url, content=small, headers=headers).status_code == 200
    gc.collect()
    base = rss_bytes()

    statuses: list[int] = []

    def send(body: bytes, rounds: int):
        with httpx.Client(timeout=300) as c:
            for _ in range(rounds):
                r = c.post(url, content=body, headers=headers)
                statuses.append(r.status_code)
                if r.status_code == 400:
                    assert "media_max_pixels" in r.json()["error"]["message"], r.text

    senders = [threading.Thread(target=send, args=(twenty, ROUNDS)) for _ in range(BOMBS)]
    senders.append(threading.Thread(target=send, args=(two, 1)))
    for t in senders:
        t.start()
    worst = {"health": 0.0, "chat": 0.0}
    probes = 0
    with httpx.Client(timeout=10) as c:
        while any(t.is_alive() for t in senders) or probes < 3:
            t0 = time.perf_counter()
            assert c.get(server.url + "/health").status_code == 200
            worst["health"] = max(worst["health"], time.perf_counter() - t0)
            t0 = time.perf_counter()
            r = c.post(url, content=small, headers=headers)
            assert r.status_code == 200, r.text
            worst["chat"] = max(worst["chat"], time.perf_counter() - t0)
            probes += 1
    for t in senders:
        t.join()
    assert sorted(statuses) == [200] + [400] * (BOMBS * ROUNDS), statuses
    assert worst["health"] < 1.0 and worst["chat"] < 1.0, (worst, probes)
    gc.collect()
    end = rss_bytes()
    print(f"\nmedia load: {probes} probes, worst /health {worst['health']:.3f} s, chat {worst['chat']:.3f} s; "
          f"RSS {base / 2**20:.0f} -> {end / 2**20:.0f} MiB")
    assert end <= base * 1.10, (base, end)
