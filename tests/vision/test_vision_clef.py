"""Clef records with images: qv's answers against Cloudflare's own `systemone()` with Hugging Face's
processor (clef_image_oracle.py, a subprocess) on a tiny Clef release folder whose backbone has a
vision tower. qv runs every record through the engine (LLM.encode_clef + LLMEngine.add_clef: its own
processor, the images after "STATE:" as Clef puts them, encoded inside prefill steps), all records
in one batch, with prefill chunks and the vision budget cutting through the images.

Also: the images matter (another image of the same size moves the answers), chunking does not (one
chunk vs 48-token chunks agree to fp32 rounding), and records whose images do not fit max_length are refused."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import pytest
from vision_cases import image

from qv import LLM
from qv.clef.answers import response
from qv.clef.request import ClefRequestError

pytest.importorskip("clef_finetune", reason="the Clef oracle needs clef-finetune (test extra, --no-deps)")

BOUND = 1e-4  # on probabilities, CPU fp32 both sides (issue 8)
SIZES = [(40, 56), (100, 70), (33, 200), (64, 64), (47, 133), (90, 60), (30, 40), (120, 90)]


def _questions(i: int) -> dict:
    qs = {
        "scene": {"type": "choice", "instructions": "What does the picture show?",
                  "criteria": {"chart": "a plot or graph", "photo": None, "text": ["scan", "document"]}},
        "quality": {"type": "score", "criteria": ["poor", "fair", "good", "sharp"][: 2 + i % 3]},
        "match": {"type": "noul", "instructions": f"Do the images match report {i}? ünïcode ✓"},
    }
    return dict(list(qs.items())[i % 3:] + list(qs.items())[: i % 3])


def records() -> list[dict]:
    """1, 2, 3, 4 and 16 images of varied sizes, string and JSON states, all three question types;
    the last one long (its state ~1,500 tokens)."""
    out = []
    for i, n in enumerate([1, 2, 3, 4, 16, 1, 2]):
        imgs = [image(200 + 10 * i + k, *SIZES[(i + k) % len(SIZES)]) for k in range(n)]
        if i == 2:
            imgs[1] = imgs[1].convert("L")  # grayscale: converted to RGB by both processors
        state = f"ticket {i}: the screenshot shows an error" if i % 2 else \
            {"ticket": i, "attachments": n, "text": "see the images", "tags": ["ui", "bug"][: 1 + i % 2]}
        out.append({"model": "clef", "state": state, "questions": _questions(i), "images": imgs})
    long_state = " ".join(f"line {k}: the upload page shows a spinner then an error." for k in range(120))
    out.append({"model": "clef", "state": long_state, "questions": _questions(7),
                "images": [image(300 + k, *SIZES[k]) for k in range(3)]})
    return out


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    from clef.fixtures import make_clef_release

    return make_clef_release(tmp_path_factory.mktemp("clef-vision") / "release", "tiny", seed=11)


@pytest.fixture(scope="module")
def oracle(release, side_torchvision, tmp_path_factory) -> list:
    work = tmp_path_factory.mktemp("clef-oracle")
    with open(work / "in.pkl", "wb") as f:
        pickle.dump(records(), f)
    script = Path(__file__).with_name("clef_image_oracle.py")
    r = subprocess.run([sys.executable, str(script), str(release), str(side_torchvision), str(work / "in.pkl"),
                        str(work / "out.pkl")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"Clef image oracle failed:\n{r.stderr[-4000:]}"
    with open(work / "out.pkl", "rb") as f:
        return pickle.load(f)


def run_all(llm: LLM, bodies: list[dict]) -> list[tuple[dict, list[list[float]]]]:
    """Every record submitted at once; (systemone response, unrounded probabilities) of each."""
    eng = llm.engine
    recs = [llm.encode_clef(b) for b in bodies]
    for i, rec in enumerate(recs):
        eng.add_clef(f"r{i}", rec)
    done = {}
    while eng.has_unfinished_requests():
        done.update((o.request_id, o) for o in eng.step() if o.finished)
    out = []
    for i, (body, rec) in enumerate(zip(bodies, recs)):
        result = done[f"r{i}"].clef
        assert result is not None, done[f"r{i}"].error
        out.append((response(body["model"], rec, result.probabilities), result.probabilities))
    return out


def max_dp(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for qa, qb in zip(a, b, strict=True) for x, y in zip(qa, qb, strict=True))


def test_clef_records_with_images_equal_clef_systemone(tiny_engine, release, oracle):
    bodies = records()
    # 48-token chunks and a vision budget of 16 patches: chunks stop inside and between images
    llm = tiny_engine(model=release, max_num_batched_tokens=48, vision_max_patches_per_step=16, clef_slots=3)
    ours = run_all(llm, bodies)
    worst = 0.0
    for i, ((got, raw), (ref, raw_ref)) in enumerate(zip(ours, oracle, strict=True)):
        assert got["usage"] == ref["usage"], (i, got["usage"], ref["usage"])  # same tokens, images included
        assert list(got["answers"]) == list(ref["answers"])
        for qid, a in got["answers"].items():
            b = ref["answers"][qid]
            assert list(a) == list(b) and a.get("legend") == b.get("legend"), (i, qid)
            assert list(a.get("probabilities", {})) == list(b.get("probabilities", {})), (i, qid)
        worst = max(worst, max_dp(raw, raw_ref))
    stats = llm.engine.media.stats
    print(f"\nClef with images: {len(bodies)} records ({sum(len(b['images']) for b in bodies)} images), "
          f"max |dp| {worst:.2e} vs Clef systemone + HF processor; {stats.steps_with_encoding} steps encoded images")
    assert worst <= BOUND
    assert stats.steps_with_encoding > 1 and stats.max_patches_in_step <= max(16, max(
        it.pixel_values.shape[0] for b in bodies for it in map(llm.engine.multimodal.processor.image, b["images"])))
    spread = [p for _, raw in oracle for q in raw for p in q]
    assert max(spread) > 0.8 and min(spread) < 0.1, (min(spread), max(spread))  # the head decides something


def test_images_matter_and_chunking_does_not(tiny_engine, release):
    body = records()[-1]
    whole = tiny_engine(model=release, max_num_batched_tokens=4096)
    (_, one_chunk), = run_all(whole, [body])
    (_, chunked), = run_all(tiny_engine(model=release, max_num_batched_tokens=48, vision_max_patches_per_step=16),
                            [body])
    assert max_dp(one_chunk, chunked) <= 1e-5
    # another picture of the same size (same tokens): only the pixels differ, so without the
    # tower's rows in place the answers would be bit-identical
    short = records()[0]
    (_, before), (_, after) = run_all(whole, [short, dict(short, images=[image(999, *SIZES[0])])])
    print(f"\nanother image moves the answers by {max_dp(before, after):.1e}")
    assert max_dp(before, after) > 1e-5


def test_images_over_max_length_are_refused(tiny_engine, release):
    llm = tiny_engine(model=release)
    body = dict(records()[4], max_length=200)  # 16 images take more than 200 tokens
    with pytest.raises(ClefRequestError, match=r"the template, images and questions take \d+ tokens before any state "
                                               r"\(\d+ of them the schema, \d+ the images\), more than the 200-token"):
        llm.encode_clef(body)
    with pytest.raises(ClefRequestError, match=r"17 images; at most 16"):
        llm.encode_clef(dict(records()[0], images=records()[4]["images"] + [image(1, 30, 30)]))
