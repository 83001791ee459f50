"""POST /v1/systemone against a running server on the embedded default model (the tiny backbone with
qv's own tiny Clef head; the real engine, no mocks): the response equals the head's answers in
systemone's format, zstd bodies work, the names `clef` and `jev-latest` answer beside the served one
(others 404), 10 Clef records and 6 chats at once all succeed with the answers each record gets
alone, images arrive as URLs, chat-style entries, base64 assets and multipart parts with the same
answers, a 10 MB state is cut before it is tokenized while /health keeps answering, a table of bad
inputs gives 400s whose messages name the limit, and the server stays healthy. Also /v1/models'
`models` list and POST /reset_prefix_cache. (The TypeSafe SDK itself: test_typesafe_sdk.py.)"""

from __future__ import annotations

import ast
import asyncio
import base64
import json
import re
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
import zstandard

from conftest import MAX_MODEL_LEN, start_server

WORDS = "order refund outage login invoice latency shipping urgent billing fraud".split()


def record(i: int) -> dict:
    """Small varied records: string or JSON state, all three question types."""
    state = " ".join(WORDS[(i * 3 + k) % len(WORDS)] for k in range(5 + i)) if i % 2 else \
        {"ticket": i, "text": " ".join(WORDS[:3 + i % 5]), "tags": WORDS[i % 4:i % 4 + 2]}
    questions = {
        "team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": "money", "tech": None,
                                                                              "ops": ["outage"]}},
        "urgency": {"type": "score", "criteria": ["later", "this week", "today"][: 2 + i % 2]},
        "down": {"type": "noul", "instructions": f"Is service {i} down?"},
    }
    return {"model": "clef", "state": state, "questions": dict(list(questions.items())[: 1 + i % 3])}


@pytest.fixture(scope="module")
def clef_server(tmp_path_factory):
    from qv.model.tiny import make_embedded

    folder = make_embedded(tmp_path_factory.mktemp("clef-server") / "embedded")
    running, stop = start_server(folder, served_model_name="qv-tiny", max_num_batched_tokens=256,
                                 prefix_caching=False, media_max_images=3, media_max_bytes=200_000)
    yield running
    stop()


def multipart(parts: list[tuple[str, bytes, str | None]], boundary: str | None = None) -> tuple[bytes, dict]:
    """A multipart/form-data body as the TypeSafe SDK writes it: (name, bytes, filename) parts."""
    boundary = boundary or uuid.uuid4().hex
    out = b""
    for name, data, filename in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        out += f"--{boundary}\r\nContent-Disposition: {disposition}\r\nContent-Type: application/octet-stream\r\n\r\n".encode()
        out += data + b"\r\n"
    return out + f"--{boundary}--\r\n".encode(), {"Content-Type": f"multipart/form-data; boundary={boundary}"}


def post(server, body, **kw) -> httpx.Response:
    with server.client() as c:
        return c.post("/v1/systemone", json=body, **kw) if not isinstance(body, bytes) else \
            c.post("/v1/systemone", content=body, **kw)


def test_answers_are_the_heads_in_systemone_format(clef_server):
    import torch

    from qv.clef.adapters import load_clef
    from qv.clef.offline import run_record
    from qv.clef.request import encode_request
    from qv.model.qwen3_5 import load_text_model
    from transformers import AutoTokenizer

    body = record(5)
    r = post(clef_server, body)
    assert r.status_code == 200, r.text
    got = r.json()
    assert list(got) == ["model", "answers", "usage"] and got["model"] == "clef"
    model = load_text_model(clef_server.model_dir)
    head = load_clef(clef_server.model_dir, model).head
    rec = encode_request(AutoTokenizer.from_pretrained(clef_server.model_dir), body, MAX_MODEL_LEN)
    with torch.inference_mode():
        probs = run_record(model, head, rec).probabilities()
    assert got["usage"] == {"input_tokens": rec.num_tokens, "output_tokens": 0}
    assert list(got["answers"]) == list(body["questions"])
    for q, p in zip(rec.questions, probs):
        ans = got["answers"][q.question_id]
        assert ans["type"] == q.type_name
        shown = {"noul": lambda: {"true": ans["noul"]}, "choice": lambda: ans["probabilities"],
                 "score": lambda: ans["probabilities"]}[q.type_name]()
        for opt, value in shown.items():
            assert abs(value - p[q.option_ids.index(opt)]) <= 1e-4 + 5e-5, (q.question_id, opt)
    choice = got["answers"]["team"]
    assert list(choice) == ["type", "choice", "confidence", "probabilities"]
    assert list(choice["probabilities"]) == ["billing", "tech", "ops"]  # request order, not the encoded order
    assert got["answers"]["urgency"]["legend"] == {"0": "later", "1": "this week", "2": "today"}
    # the same body zstd-compressed (Content-Encoding: zstd, as the TypeSafe SDK sends it)
    packed = zstandard.ZstdCompressor().compress(json.dumps(body).encode())
    z = post(clef_server, packed, headers={"Content-Type": "application/json", "Content-Encoding": "zstd"})
    assert z.status_code == 200, z.text
    assert z.json() == got


def test_clef_names_beside_the_served_ones(clef_server):
    """`clef` and `jev-latest` (the TypeSafe SDK's default) answer as the served name does, and the
    response names the model asked for; any other name is the usual 404."""
    body = record(2)
    answers = []
    for name in ("clef", "jev-latest", "qv-tiny"):
        r = post(clef_server, dict(body, model=name))
        assert r.status_code == 200, r.text
        assert r.json()["model"] == name
        answers.append(r.json()["answers"])
    assert answers[0] == answers[1] == answers[2]
    r = post(clef_server, dict(body, model="gpt-4"))
    assert r.status_code == 404, r.text
    assert r.json()["error"] == {"message": "The model `gpt-4` does not exist.", "type": "NotFoundError",
                                 "param": "model", "code": 404}


def assert_same_answers(got: dict, ref: dict, tol: float = 2e-4) -> None:
    """Same usage, questions, keys, choices, legends and option order; every number within `tol`
    (both sides are rounded to 4 decimals, from values that differ by fp32 rounding)."""
    assert got["usage"] == ref["usage"] and list(got["answers"]) == list(ref["answers"])
    for q, a in got["answers"].items():
        b = ref["answers"][q]
        assert list(a) == list(b) and a.get("legend") == b.get("legend"), q
        assert list(a.get("probabilities", {})) == list(b.get("probabilities", {})), q
        pairs = [(a[k], b[k]) for k in ("noul", "score", "confidence") if k in a]
        pairs += [(a["probabilities"][o], b["probabilities"][o]) for o in a.get("probabilities", {})]
        assert all(abs(x - y) <= tol for x, y in pairs), (q, a, b)
        if a.get("choice") != b.get("choice"):  # only a near-tie may flip the choice
            top = sorted(b["probabilities"].values())[-2:]
            assert top[1] - top[0] <= 2 * tol, (q, a, b)


async def _all_at_once(server, records: list[dict], chats: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
        calls = [http.post("/v1/systemone", json=b) for b in records]
        calls += [http.post("/v1/chat/completions", json={
            "model": "qv-tiny", "messages": [{"role": "user", "content": f"chat {j} " + "hello " * j}],
            "max_tokens": 8, "temperature": 0, "ignore_eos": True}) for j in range(chats)]
        return await asyncio.gather(*calls)


def test_ten_records_and_six_chats_at_once(clef_server):
    bodies = [record(i) for i in range(10)]
    alone = [post(clef_server, b).json() for b in bodies]
    out = asyncio.run(_all_at_once(clef_server, bodies, 6))
    assert [r.status_code for r in out] == [200] * 16, [r.text for r in out if r.status_code != 200]
    for got, ref in zip((r.json() for r in out[:10]), alone):
        assert_same_answers(got, ref)
    assert all(r.json()["usage"]["completion_tokens"] == 8 for r in out[10:])
    assert clef_server.metric("vllm:num_requests_running") == 0


def png_url(seed: int, h: int, w: int, bare: bool = False) -> str:
    """A random RGB picture as a PNG data URL (or bare base64)."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    data = base64.b64encode(buf.getvalue()).decode()
    return data if bare else "data:image/png;base64," + data


def png_bytes(seed: int, h: int, w: int) -> bytes:
    return base64.b64decode(png_url(seed, h, w, bare=True))


def test_records_with_images(clef_server):
    """Images as data URLs and bare base64: answered as the engine answers them offline (the
    oracle comparison with Clef's systemone() is tests/vision/test_vision_clef.py)."""
    import io

    from PIL import Image

    from qv import LLM

    urls = [png_url(11, 40, 56), png_url(12, 90, 60, bare=True), png_url(13, 33, 120)]
    bodies = [dict(record(i), images=urls[: 1 + i]) for i in range(3)]
    out = asyncio.run(_all_at_once(clef_server, bodies, 2))
    assert [r.status_code for r in out] == [200] * 5, [r.text for r in out if r.status_code != 200]
    pictures = [Image.open(io.BytesIO(base64.b64decode(u.split(",")[-1]))) for u in urls]
    offline = LLM(clef_server.model_dir, max_model_len=MAX_MODEL_LEN).decide(
        [dict(b, images=pictures[: len(b["images"])]) for b in bodies])
    for got, ref in zip((r.json() for r in out), offline):
        assert_same_answers(got, ref)
    text_only = post(clef_server, record(0)).json()["usage"]["input_tokens"]
    assert out[0].json()["usage"]["input_tokens"] > text_only + 3  # the image's tokens count as input


def test_every_image_form_gives_the_same_record(clef_server):
    """One picture sent five ways gives one answer: a data URL, chat's {"image_url": {"url": ...}}
    (with and without "type"), a base64 asset, and a multipart part named by an asset (plain and
    zstd-compressed, as the TypeSafe SDK sends it). Placeholders read "[image N]", so a record
    with an asset and its placeholder answers as the same record with the label written out; and
    another picture moves the answers."""
    data = png_bytes(21, 48, 64)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    base = dict(record(4), state="the photo [image 1] shows the outage page")
    forms = [dict(base, images=[url]), dict(base, images=[{"image_url": {"url": url}}]),
             dict(base, images=[{"type": "image_url", "image_url": url}])]
    asset = dict(base, state="the photo <image:abc> shows the outage page")
    forms.append(dict(asset, assets={"<image:abc>": {"type": "image", "format": "png",
                                                     "data_base64": base64.b64encode(data).decode()}}))
    got = [post(clef_server, b) for b in forms]
    request = json.dumps(dict(asset, assets={"<image:abc>": {"type": "image", "part": "asset-0"}})).encode()
    body, headers = multipart([("request", request, None), ("asset-0", data, "asset-0")])
    got.append(post(clef_server, body, headers=headers))
    got.append(post(clef_server, zstandard.ZstdCompressor().compress(body), headers=dict(headers, **{
        "Content-Encoding": "zstd"})))
    assert [r.status_code for r in got] == [200] * 6, [r.text for r in got]
    assert all(r.json() == got[0].json() for r in got)
    other = post(clef_server, dict(base, images=[png_url(22, 48, 64)])).json()
    assert other["usage"] == got[0].json()["usage"] and other["answers"] != got[0].json()["answers"]


def test_ten_megabyte_state_is_cut_before_tokenizing(clef_server):
    """A 10 MB state: answered as the same record with the state's first 100 KB (the cut is exact),
    in seconds, while /health keeps answering (parsing and encoding run off the event loop)."""
    words = "the checkout fails again and every order is blocked ".split()
    state = " ".join(words[i % len(words)] for i in range(2_000_000))
    big = dict(record(3), state=state, max_length=700)
    latencies, done = [], threading.Event()

    def poll():
        with clef_server.client() as c:
            while not done.is_set():
                t = time.perf_counter()
                assert c.get("/health").status_code == 200
                latencies.append(time.perf_counter() - t)
                time.sleep(0.02)

    watcher = threading.Thread(target=poll)
    watcher.start()
    try:
        start = time.perf_counter()
        r = post(clef_server, big)
        took = time.perf_counter() - start
    finally:
        done.set()
        watcher.join()
    assert r.status_code == 200, r.text
    small = post(clef_server, dict(big, state=state[:100_000]))
    assert r.json() == small.json() and r.json()["usage"]["input_tokens"] == 700
    print(f"\n10 MB state: answered in {took:.2f} s; /health at most {max(latencies):.3f} s over {len(latencies)} polls")
    assert took < 20 and len(latencies) >= 3 and max(latencies) < 1.0, (took, max(latencies))


def test_the_endpoint_imports_the_engine_the_server_and_clef_parsing_only():
    """Parsing and answers come from qv.clef (request, answers, limits: tests/test_repo.py's
    SERVER_CLEF_MODULES); the head and the record's run are the engine's."""
    tree = ast.parse((Path(__file__).resolve().parents[2] / "qv" / "server" / "systemone.py").read_text())
    mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("qv")}
    mods |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names if a.name.startswith("qv")}
    clef = {"qv.clef.request", "qv.clef.answers", "qv.clef.limits"}
    assert mods and all(m.split(".")[1] in ("engine", "server") or m in clef for m in mods), mods


DROP = object()  # a field to leave out
LONG = {f"q{i}": {"type": "noul", "instructions": "Is it so? " * 4} for i in range(40)}
BAD = [  # (body or raw bytes, extra headers, message pattern)
    (b"{", {}, r"not valid JSON"),
    (b"[" * 5000 + b"]" * 5000, {}, r"not valid JSON"),  # nested past the parser's recursion limit
    ({"questions": {"q": {"type": ["noul"]}}}, {}, r"question 'q': unknown type \['noul'\]"),
    (b"[1, 2]", {}, r"must be a JSON object, got array"),
    ({"temperature": 0}, {}, r"unknown field\(s\) 'temperature'; allowed: model, state, questions"),
    ({"model": DROP}, {}, r"'model' is required"),
    ({"state": DROP}, {}, r"'state' is required"),
    ({"questions": []}, {}, r"'questions' must be an object mapping question id to question, got array"),
    ({"questions": {}}, {}, r"'questions' is empty"),
    ({"questions": {f"q{i}": {"type": "noul"} for i in range(65)}}, {}, r"65 questions; at most 64 questions"),
    ({"questions": {"q": "yes?"}}, {}, r"question 'q': must be an object, got string"),
    ({"questions": {"q": {"type": "box"}}}, {}, r"question 'q': unknown type 'box'; supported: noul, choice, score"),
    ({"questions": {"q": {"type": "noul", "labels": []}}}, {}, r"question 'q': unknown field\(s\) 'labels'"),
    ({"questions": {"q": {"type": "choice"}}}, {}, r"a choice question needs non-empty criteria"),
    ({"questions": {"q": {"type": "score", "criteria": []}}}, {}, r"a score question needs non-empty criteria"),
    ({"questions": {"q": {"type": "choice", "criteria": ["a", "b"]}}}, {}, r"choice criteria must be an object"),
    ({"questions": {"q": {"type": "score", "criteria": {"a": 1}}}}, {}, r"score criteria must be an array"),
    (b'{"model": "clef", "state": "s", "questions": {"q": {"type": "choice", "criteria": {"a": 1, "a": 2}}}}', {},
     r"question 'q': duplicate option id\(s\) 'a' given more than once"),
    ({"questions": {"q": {"type": "choice", "criteria": {"": "none"}}}}, {}, r"option ids must be non-empty"),
    (b'{"model": "clef", "state": "s", "questions": {"q": {"type": "noul"}, "q": {"type": "noul"}}}', {},
     r"question id\(s\) 'q' given more than once"),
    ({"questions": {"q": {"type": "score", "criteria": list(range(257))}}}, {},
     r"question 'q': 257 options; at most 256 options per question"),
    ({"questions": {f"q{i}": {"type": "score", "criteria": list(range(225))} for i in range(2)}}, {},
     r"450 options in total; at most 448 options per record"),
    ({"images": ["data:image/png;base64,AAAA"] * 17}, {}, r"17 images; at most 16 images per record"),
    ({"images": "data:image/png;base64,AAAA"}, {}, r"'images' must be an array, got string"),
    ({"images": [7]}, {}, r"images\[0\] must be a non-empty string: an http\(s\) URL, a data URL or base64 data"),
    ({"images": [{"image_url": {"href": "x"}}]}, {}, r'images\[0\]: an image object is \{"image_url": \{"url"'),
    ({"images": [{"image_url": {"url": "data:image/png;base64,AAAA"}}]}, {}, r"images\[0\]: could not decode the image"),
    ({"assets": {"<image:a>": {"data_base64": "AAAA"}}}, {}, r"assets\.<image:a>: could not decode the image"),
    ({"assets": {"<image:a>": {"type": "image", "part": "asset-0"}}}, {},
     r"asset '<image:a>' names part 'asset-0', which the request does not have \(it is not a multipart body\)"),
    ({"assets": {}}, {}, r"'assets' is empty"),
    (b'{"model": "clef", "state": "s", "questions": {"q": {"type": "score", "criteria": [NaN, Infinity]}}}', {},
     r"questions\.q\.criteria\[0\]: NaN is not a number JSON allows; numbers must be finite"),
    (b'{"model": "clef", "state": 1e400, "questions": {"q": {"type": "noul"}}}', {}, r"state: Infinity is not a number"),
    (b'{"model": "clef", "state": "a\\ud800b", "questions": {"q": {"type": "noul"}}}', {},
     r"state: a lone UTF-16 surrogate \('\\ud800' at character 1\)"),
    (b'{"model": "clef", "state": "", "questions": {"q\\udfff": {"type": "noul"}}}', {},
     r"questions\.q\\udfff: a lone UTF-16 surrogate"),
    (b'{"model": "clef", "state": ' + b"[" * 200 + b"]" * 200 + b', "questions": {"q": {"type": "noul"}}}', {},
     r"state: JSON nested deeper than 128 levels"),
    *[(body, headers, pattern) for body, headers, pattern in (
        multipart([("asset-0", b"png", "a")]) + (r"needs a 'request' part holding the JSON request",),
        multipart([("request", b'{"model": "clef", "state": "s", "questions": {"q": {"type": "noul"}}}', None),
                   ("asset-0", b"png", "a")]) + (r"multipart part\(s\) 'asset-0' belong to no asset",),
        multipart([("request", b"{", None)]) + (r"not valid JSON",),
        multipart([("request", b"{}", None), ("request", b"{}", None)]) + (r"part 'request' is given more than once",),
        multipart([("request", b"{}", None)] + [(f"asset-{i}", b"x", "x") for i in range(17)])
        + (r"more than 17 parts \(a 'request' part and at most 16 images\)",),
        (multipart([("request", b"{}", None)], "b0")[0][:-8], {"Content-Type": "multipart/form-data; boundary=b0"},
         r"multipart body ends before its closing boundary"),
        (b"--b0\r\n", {"Content-Type": "multipart/form-data"}, r"Content-Type has no boundary"),
        multipart([("request", json.dumps(dict(record(0), assets={"<image:a>": {"part": "asset-0"}})).encode(), None),
                   ("asset-0", b"\x89PNG" + bytes(300_000), "asset-0")])
        + (r"assets\.<image:a>: media is larger than the 200000-byte limit",),
    )],
    ({"images": ["data:image/png;base64,AAAA"]}, {}, r"images\[0\]: could not decode the image"),
    ({"images": ["data:image/png;base64,@@@"]}, {}, r"images\[0\]: .*base64"),
    ({"images": [png_url(1, 64, 64)] * 4}, {}, r"4 images; this server takes at most 3 images per request "
                                                r"\(media_max_images\)"),
    ({"images": [png_url(1, 64, 64)] * 3, "max_length": 110}, {},
     r"the template, images and questions take \d+ tokens before any state \(\d+ of them the schema, \d+ the "
     r"images\), more than the 110-token max_length"),
    ({"videos": ["https://example.com/a.mp4"]}, {}, r"videos are not supported for Clef records"),
    ({"max_length": "long"}, {}, r"'max_length' must be a positive integer, got 'long'"),
    ({"max_length": 0}, {}, r"'max_length' must be a positive integer, got 0"),
    ({"max_length": 5000}, {}, rf"max_length 5000 is over this server's Clef record cap of {MAX_MODEL_LEN} tokens "
                               r"\(max_model_len\)"),
    ({"max_length": 60}, {}, r"record too long: the template, images and questions take \d+ tokens before any state "
                             r"\(\d+ of them the schema\), more than the 60-token max_length"),
    ({"questions": LONG}, {}, rf"take \d+ tokens .* more than the {MAX_MODEL_LEN}-token Clef record cap "
                              r"\(max_model_len\)"),
    ({"questions": {"q": {"type": "noul", "criteria": {"maybe": "?"}}}}, {},
     r"noul criteria keys must be 'true' and/or 'false', got 'maybe'"),
    (b'{"model": "clef"}', {"Content-Type": "text/plain"}, r"Only 'application/json' or 'multipart/form-data' is allowed"),
    (b"not zstd at all", {"Content-Type": "application/json", "Content-Encoding": "zstd"}, r"could not be decompressed"),
    (zstandard.ZstdCompressor().compress(b'{"model": "clef", "extra": 1}'),
     {"Content-Type": "application/json", "Content-Encoding": "zstd"}, r"unknown field\(s\) 'extra'"),
    (b'{"model": "clef"}', {"Content-Type": "application/json", "Content-Encoding": "gzip"},
     r"unsupported Content-Encoding 'gzip'"),
]


def _complete(body):
    """A bad field on an otherwise valid body, so each case trips exactly its own check."""
    if isinstance(body, bytes):
        return body
    full = {"model": "clef", "state": "the checkout fails", "questions": {"q": {"type": "noul"}}}
    full.update(body)
    return {k: v for k, v in full.items() if v is not DROP}


def _headers(body, headers):
    return headers or ({"Content-Type": "application/json"} if isinstance(body, bytes) else {})


@pytest.mark.parametrize("case", range(len(BAD)))
def test_bad_input_is_a_400_that_names_the_limit(clef_server, case):
    body, headers, pattern = BAD[case]
    r = post(clef_server, _complete(body), headers=_headers(body, headers))
    assert r.status_code == 400, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["type"] == "BadRequestError" and re.search(pattern, err["message"]), err["message"]


def test_healthy_after_bad_inputs(clef_server):
    for body, headers, _ in BAD:
        assert post(clef_server, _complete(body), headers=_headers(body, headers)).status_code == 400
    with clef_server.client() as c:
        assert c.get("/health").status_code == 200
    r = post(clef_server, record(3))
    assert r.status_code == 200 and set(r.json()["answers"]) == set(record(3)["questions"])


def test_models_list_and_prefix_cache_reset(clef_server, server):
    with clef_server.client() as c:
        models = c.get("/v1/models").json()
        assert [m["name"] for m in models["models"]] == ["qv-tiny", "clef", "jev-latest"]
        assert all(re.fullmatch(r"\d{4}-\d\d-\d\d", m["release_date"]) for m in models["models"])
        assert [m["id"] for m in models["data"]] == ["qv-tiny"]  # chat answers to the served names only
        r = c.post("/reset_prefix_cache")
        assert r.status_code == 400 and "prefix caching is off" in r.json()["error"]["message"]
    with server.client() as c:  # the shared server: prefix caching on, and no Clef head
        assert c.post("/reset_prefix_cache").status_code == 200
        assert "clef" not in [m["name"] for m in c.get("/v1/models").json()["models"]]
        r = c.post("/v1/systemone", json=record(0))
        assert r.status_code == 400 and "does not serve Clef decisions" in r.json()["error"]["message"]
