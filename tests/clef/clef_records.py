"""Varied, deterministic Clef records for the oracle comparisons: string and JSON states, all three
question types, 1..64 questions, unicode, long instructions, descriptions of every JSON kind,
option ids whose sorted order differs from the given order, and states long enough to be cut."""

from __future__ import annotations

import random

WORDS = ("order checkout payment refund invoice outage latency login password error timeout shipping "
         "customer account warehouse delay urgent billing technical security fraud report").split()
UNICODE = ["Привет, мир! Заказ не пришёл.", "こんにちは世界、注文が届きません。", "Ünïcödé façade naïve café",
           "😀 — “quotes” and 'single' ones", "emoji 🚀🔥 mixed with text ✓", "tab\tand\nnewlines\r\n"]
SPECIAL = "literal <|im_end|> and <think> tags inside the state"


def _text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def _json_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(7 if depth < 2 else 4)
    if kind == 0:
        return _text(rng, rng.randint(1, 6))
    if kind == 1:
        return rng.choice([0, 1, -3, 2.5, 1e-3, 12345678901])
    if kind == 2:
        return rng.choice([True, False, None])
    if kind == 3:
        return rng.choice(UNICODE)
    if kind in (4, 5):
        return {f"{rng.choice(WORDS)}_{i}": _json_value(rng, depth + 1) for i in range(rng.randint(1, 4))}
    return [_json_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]


def _state(rng: random.Random, size: int):
    kind = rng.randrange(6)
    if kind == 0:
        return _text(rng, size)
    if kind == 1:
        return rng.choice(UNICODE) + " " + _text(rng, size // 2)
    if kind == 2:
        return {"ticket": _text(rng, size // 2), "meta": _json_value(rng), "id": rng.randint(1, 10**6)}
    if kind == 3:
        return [_json_value(rng) for _ in range(max(1, size // 8))]
    if kind == 4:
        return SPECIAL + " " + _text(rng, size // 2)
    return rng.choice([42, 3.25, True, None, ""])


def _description(rng: random.Random):
    return rng.choice([None, _text(rng, rng.randint(1, 5)), {"meaning": _text(rng, 2), "weight": rng.randint(1, 9)},
                       [_text(rng, 1), rng.randint(0, 3)], rng.choice(UNICODE)])


def _instructions(rng: random.Random, long: bool):
    if long:
        return "Read carefully. " + _text(rng, 120)
    return rng.choice([None, "", _text(rng, rng.randint(2, 10)) + "?", {"ask": _text(rng, 3), "lang": "en"},
                       [_text(rng, 2), _text(rng, 2)], rng.choice(UNICODE)])


def _question(rng: random.Random, long: bool, max_options: int):
    kind = rng.choice(["noul", "choice", "score"])
    q: dict = {"type": kind}
    ins = _instructions(rng, long)
    if ins is not None or rng.random() < 0.5:
        q["instructions"] = ins
    if kind == "noul":
        if rng.random() < 0.4:
            q["criteria"] = rng.choice([{"true": _text(rng, 3)}, {"false": None}, {"true": "yes", "false": "no"}])
    elif kind == "choice":
        ids = rng.sample(["billing", "technical", "B", "a", "10", "2", "Z_9", "ßeta", "naïve", "x y", "-", "ok"],
                         rng.randint(1, min(6, max_options)))
        q["criteria"] = {i: _description(rng) for i in ids}
    else:
        q["criteria"] = [_description(rng) for _ in range(rng.randint(2, min(10, max_options)))]
    return q


def make_record(seed: int, n_questions: int | None = None, state_size: int | None = None, long: bool = False,
                max_options: int = 6, small: bool = False) -> dict:
    """A random record; `small` keeps it to a few hundred tokens (CPU oracle runs are O(T^2))."""
    rng = random.Random(seed)
    n_questions = n_questions or rng.choice([1, 1, 1, 2, 3] if small else [1, 1, 2, 3, 4, 6, 9])
    questions = {}
    while len(questions) < n_questions:
        qid = rng.choice([f"q{len(questions)}", f"{rng.choice(WORDS)}_{len(questions)}", f"field.{len(questions)}"])
        questions[qid] = _question(rng, long and (not questions or rng.random() < 0.5), 3 if small else max_options)
    size = state_size or (rng.randint(2, 16) if small else rng.randint(3, 60))
    return {"model": "clef", "state": _state(rng, size), "questions": questions}


def many_questions(n: int, seed: int = 7) -> dict:
    """n small questions (all three types, options without descriptions) with a short state: the
    1..64 range at the fewest tokens the template allows (~65 per question)."""
    rng = random.Random(seed)
    qs = {}
    for i in range(n):
        kind = ("noul", "choice", "score")[i % 3]
        q: dict = {"type": kind}
        if kind == "choice":
            q["criteria"] = {c: None for c in rng.sample("abcdef", 2)}
        elif kind == "score":
            q["criteria"] = [None, None, None]
        else:
            q["criteria"] = {"true": None, "false": None}
        qs[f"q{i}"] = q
    return {"model": "clef", "state": _text(rng, 10), "questions": qs}


def encode_cases() -> list[tuple[dict, int]]:
    """(record, max_length) pairs for the encoder comparison: >= 30, varied, some cut."""
    cases = [(make_record(s), 16384) for s in range(24)]
    cases += [(make_record(100 + s, long=True), 16384) for s in range(4)]
    cases += [(many_questions(n), 16384) for n in (1, 17, 64)]
    cases += [(make_record(200 + s, n_questions=1, state_size=500), 500 + 100 * s) for s in range(4)]  # state cut
    cases.append(({"model": "clef", "state": "", "questions": {"only": {"type": "noul"}}}, 16384))
    return cases


def answer_cases(layout_seed: int, most_questions: int = 64) -> list[dict]:
    """30 records for the answer comparison, kept small for the CPU oracle runs (their cost is
    the tokens): 26 small random ones, one with long instructions, 13 and `most_questions`
    questions, unicode option ids."""
    out = [make_record(1000 * layout_seed + s, small=True) for s in range(26)]
    out.append(make_record(1000 * layout_seed + 50, n_questions=1, long=True, small=True))
    out += [many_questions(n, seed=layout_seed) for n in (13, most_questions)]
    out.append({"model": "clef", "state": SPECIAL, "questions": {"u": {"type": "choice", "criteria": {
        "é": "accent", "e": None, "😀": ["emoji"]}}}})
    return out


def run_engine(eng, records: dict, chats: dict | None = None, chat_params=None) -> dict:
    """Chats first (so they decode beside the records' prefill chunks), then records; run to the end.
    Returns request id -> its finished output."""
    for rid, ids in (chats or {}).items():
        eng.add_request(rid, ids, chat_params)
    for rid, rec in records.items():
        eng.add_clef(rid, rec)
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    return done


def max_dp(a, b) -> float:
    """The largest difference between two records' per-option probabilities."""
    return max(abs(x - y) for qa, qb in zip(a, b) for x, y in zip(qa, qb))
