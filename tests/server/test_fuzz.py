"""A bounded, seeded fuzz run over a schema of the request bodies written for this test (chat,
completions, responses, tokenize): valid bodies are drawn from the schema, then mutated (wrong types,
huge numbers, deep nesting, lone surrogates, NaN/Infinity literals, missing and unknown fields). Every
answer must be a 200 or a 4xx with an OpenAI-style JSON error, never a 5xx; the server stays healthy."""

from __future__ import annotations

import json
import random
import re

import httpx

CASES = 320
SEED = 2024_11_30

# A compact schema: field -> kind. Required fields are marked with "!". Output lengths ("tokens") stay
# small and are never removed, so every accepted request finishes in a few steps.
TEXT, NUMBER, INT, BOOL = "text", "number", "int", "bool"
SCHEMA = {
    "/v1/chat/completions": {
        "messages!": "messages", "max_tokens!": "tokens", "temperature": NUMBER, "top_p": "unit", "top_k": INT,
        "min_p": "unit", "presence_penalty": "penalty", "frequency_penalty": "penalty", "seed": INT, "n": "n",
        "stop": "stop", "stream": BOOL, "logprobs": BOOL, "tools": "tools", "tool_choice": "tool_choice",
        "chat_template_kwargs": "kwargs", "stop_token_ids": "ids", "ignore_eos": BOOL, "user": TEXT,
    },
    "/v1/completions": {
        "prompt!": "prompt", "max_tokens!": "tokens", "temperature": NUMBER, "top_p": "unit", "top_k": INT,
        "n": "n", "seed": INT, "stop": "stop", "stream": BOOL, "logprobs": "small_int", "echo": BOOL,
        "min_tokens": "small_int", "repetition_penalty": "positive",
    },
    "/v1/responses": {
        "input!": "input", "max_output_tokens!": "tokens", "instructions": TEXT, "temperature": NUMBER,
        "top_p": "unit", "stream": BOOL, "tools": "responses_tools", "metadata": "kwargs",
    },
    "/tokenize": {"prompt!": TEXT, "add_special_tokens": BOOL, "return_token_strs": BOOL},
}


def valid(kind: str, rng: random.Random):
    word = lambda: rng.choice(["hi", "sea", "Привет", "世界", "😀", "a b", "<think>", "x" * 40])  # noqa: E731
    if kind == TEXT:
        return " ".join(word() for _ in range(rng.randint(1, 4)))
    if kind == NUMBER:
        return rng.choice([0, 0.5, 1, 1.3])
    if kind == INT:
        return rng.randint(-5, 10**6)
    if kind == BOOL:
        return rng.random() < 0.5
    if kind == "unit":
        return rng.choice([0.1, 0.9, 1])
    if kind == "penalty":
        return rng.choice([-2, 0, 1.5])
    if kind == "positive":
        return rng.choice([0.5, 1, 1.2])
    if kind == "tokens":
        return rng.randint(1, 3)
    if kind in ("n", "small_int"):
        return rng.randint(1, 2)
    if kind == "stop":
        return rng.choice([word(), [word(), "\n"]])
    if kind == "ids":
        return [rng.randint(0, 300)]
    if kind == "messages":
        roles = ["system", "user", "assistant", "user"][-rng.randint(1, 4):]
        return [{"role": r, "content": valid(TEXT, rng) if rng.random() < 0.7 else
                 [{"type": "text", "text": valid(TEXT, rng)}]} for r in roles]
    if kind == "prompt":
        return rng.choice([valid(TEXT, rng), [valid(TEXT, rng), valid(TEXT, rng)], [1, 2, 3]])
    if kind == "input":
        return rng.choice([valid(TEXT, rng), [{"role": "user", "content": valid(TEXT, rng)}]])
    if kind == "tools":
        return [{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}}}}]
    if kind == "responses_tools":
        return [{"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}]
    if kind == "tool_choice":
        return rng.choice(["none", "auto"])
    if kind == "kwargs":
        return {"enable_thinking": rng.random() < 0.5}
    raise AssertionError(kind)


def body_for(path: str, rng: random.Random) -> dict:
    body = {}
    for field, kind in SCHEMA[path].items():
        required = field.endswith("!")
        if required or rng.random() < 0.3:
            body[field.rstrip("!")] = valid(kind, rng)
    if "tool_choice" in body and "tools" not in body:
        body["tools"] = valid("tools", rng)
    return body


SURROGATE = "\ud800"  # json.dumps writes it as the escape "\ud800", which is not text
HOSTILE = [None, True, False, 0, -1, 2**64, -(2**70), 1e308, 4.5, "", "1", "true", [], [None], {}, {"a": None},
           [[1]], SURROGATE, "x" + SURROGATE, [SURROGATE], {"k": SURROGATE}, float("inf"), float("nan")]
TOKENS_HOSTILE = [0, -1, 2**64, 4.5, "2", True, None, [], 1e999]  # never a valid large value: runs stay short


def deep(depth: int):
    node = 1
    for _ in range(depth):
        node = {"a": node} if depth % 2 else [node]
    return node


def mutate(body: dict, path: str, rng: random.Random) -> None:
    """One mutation somewhere in the body: replace, delete or add a field, or nest deeply."""
    schema = {k.rstrip("!"): v for k, v in SCHEMA[path].items()}
    node, key = body, None
    while True:
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        if not keys:
            break
        key = rng.choice(keys)
        child = node[key]
        if node is not body and isinstance(child, (dict, list)) and child and rng.random() < 0.5:
            node = child
            continue
        if node is body and isinstance(child, (dict, list)) and child and rng.random() < 0.4:
            node = child
            continue
        break
    if node is body and schema.get(key) == "tokens":
        node[key] = rng.choice(TOKENS_HOSTILE)
        return
    roll = rng.random()
    if roll < 0.1 and isinstance(node, dict) and schema.get(key) != "tokens":
        del node[key]
    elif roll < 0.2 and isinstance(node, dict):
        node["unexpected_" + str(rng.randint(0, 9))] = rng.choice(HOSTILE)
    elif roll < 0.3 and key is not None:
        node[key] = deep(rng.choice([50, 199, 260, 900]))
    elif key is not None:
        node[key] = rng.choice(HOSTILE)


def encode(body: dict, rng: random.Random) -> bytes:
    raw = json.dumps(body)  # writes NaN / Infinity literals and \ud800 escapes as given
    if rng.random() < 0.05:
        raw = raw[: rng.randint(1, len(raw))]  # cut short: malformed JSON
    return raw.encode("utf-8", "surrogatepass")


def test_schema_fuzz_never_gives_5xx(server):
    rng = random.Random(SEED)
    paths = list(SCHEMA)
    seen: dict[int, int] = {}
    with httpx.Client(base_url=server.url, timeout=120) as c:
        for i in range(CASES):
            path = paths[i % len(paths)]
            body = body_for(path, rng)
            for _ in range(rng.choice([0, 1, 1, 2, 3])):
                mutate(body, path, rng)
            raw = encode(body, rng)
            r = c.post(path, content=raw, headers={"content-type": "application/json"})
            seen[r.status_code] = seen.get(r.status_code, 0) + 1
            assert r.status_code < 500, (path, raw[:500], r.text[:500])
            if r.status_code != 200:
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["code"] == r.status_code, r.text
                assert isinstance(err["message"], str) and err["message"], r.text
            elif r.headers["content-type"].startswith("text/event-stream"):
                last = r.text.rstrip().rsplit("\n", 1)[-1]
                assert last == "data: [DONE]" or re.search(r'"type":"response\.(completed|incomplete)"', last), last
            else:
                r.json()
        assert c.get("/health").status_code == 200
    print(seen)
    assert seen.get(200, 0) >= 40 and seen.get(400, 0) >= 100, seen  # both kinds were exercised
    assert server.metric("vllm:num_requests_running") == 0
