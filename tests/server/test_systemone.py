"""POST /v1/systemone against a running server on a tiny Clef release folder (the real engine, no
mocks): the response equals the head's answers in systemone's format, zstd bodies work, 10 Clef
records and 6 chats at once all succeed with the answers each record gets alone, a table of bad
inputs gives 400s whose messages name the limit, and the server stays healthy. Also
/v1/models' `models` list and POST /reset_prefix_cache."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest
import zstandard

from conftest import MAX_MODEL_LEN, start_server

pytest.importorskip("clef_finetune", reason="the Clef fixture head needs clef-finetune (test extra, --no-deps)")

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
    from qv.clef.fixtures import make_clef_release

    folder = make_clef_release(tmp_path_factory.mktemp("clef-server") / "release", "tiny", seed=3)
    running, stop = start_server(folder, served_model_name="clef,qv-tiny", max_num_batched_tokens=256,
                                 prefix_caching=False, media_max_images=3)
    yield running
    stop()


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


def test_records_with_images(clef_server):
    """Images as data URLs and bare base64: answered as the engine answers them offline (the
    oracle comparison with Clef's systemone() is tests/vision/test_vision_clef.py)."""
    import base64
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


DROP = object()  # a field to leave out
LONG = {f"q{i}": {"type": "noul", "instructions": "Is it so? " * 4} for i in range(40)}
BAD = [  # (body or raw bytes, extra headers, message pattern)
    (b"{", {}, r"not valid JSON"),
    (b"[" * 5000 + b"]" * 5000, {}, r"not valid JSON"),  # nested past the parser's recursion limit
    ({"questions": {"q": {"type": ["noul"]}}}, {}, r"question 'q': unknown type \['noul'\]"),
    (b"[1, 2]", {}, r"must be a JSON object, got list"),
    ({"temperature": 0}, {}, r"unknown field\(s\) 'temperature'; allowed: model, state, questions"),
    ({"model": DROP}, {}, r"'model' is required"),
    ({"model": "gpt-4"}, {}, r"model 'gpt-4' is not served here; served: clef, qv-tiny"),
    ({"state": DROP}, {}, r"'state' is required"),
    ({"questions": []}, {}, r"'questions' must be an object mapping question id to question, got array"),
    ({"questions": {}}, {}, r"'questions' is empty"),
    ({"questions": {f"q{i}": {"type": "noul"} for i in range(65)}}, {}, r"65 questions; at most 64 questions"),
    ({"questions": {"q": "yes?"}}, {}, r"question 'q' must be an object, got string"),
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
     r"question 'q' has 257 options; at most 256 options per question"),
    ({"questions": {f"q{i}": {"type": "score", "criteria": list(range(225))} for i in range(2)}}, {},
     r"450 options in total; at most 448 options per record"),
    ({"images": ["data:image/png;base64,AAAA"] * 17}, {}, r"17 images; at most 16 images per record"),
    ({"images": "data:image/png;base64,AAAA"}, {}, r"'images' must be an array, got string"),
    ({"images": [7]}, {}, r"images\[0\] must be a non-empty string: an http\(s\) URL, a data URL or base64 data"),
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
    (b'{"model": "clef"}', {"Content-Type": "text/plain"}, r"Only 'application/json' is allowed"),
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
        assert [m["name"] for m in models["models"]] == ["clef", "qv-tiny"]
        assert [m["id"] for m in models["data"]] == ["clef", "qv-tiny"]
        r = c.post("/reset_prefix_cache")
        assert r.status_code == 400 and "prefix caching is off" in r.json()["error"]["message"]
    with server.client() as c:  # the shared server: prefix caching on, and no Clef head
        assert c.post("/reset_prefix_cache").status_code == 200
        r = c.post("/v1/systemone", json=record(0))
        assert r.status_code == 400 and "does not serve Clef decisions" in r.json()["error"]["message"]
