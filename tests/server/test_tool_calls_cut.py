"""A forced call (tool_choice `required` or a named function) that max_tokens or a stop string cuts
is no call: its text is the content, the calls that ended before it (their `</tool_call>` written)
are the tool_calls, finish_reason is the engine's (`length`, `stop`), streamed and not alike. A cut
call is never passed off as a finished one (before, the parser closed it and sent `{}` or arguments
missing required parameters).

vLLM differs and disagrees with itself here: a named call returns the cut JSON as its arguments, a
`required` one returns no calls and no content unstreamed but streams the cut arguments with
finish_reason `tool_calls`.

- The parser alone: random walks over the call grammar's token masks, cut after every token: the
  calls are the full output's first m, m the `</tool_call>`s in the cut text, the content what
  follows the last of them (None when blank), and the stream, in random chunks, equals the parse.
- Through the official openai client on the tiny model: full forced calls cut at random token
  counts and one token short of their end, streamed and not, against the detokenized cut; calls
  repeated until the limit (greedy) keep those that ended; the SDK's `parse` and stream helper
  report the cut (LengthFinishReasonError) with the text as content; a stop string inside the call,
  and inside a later call (finish "stop": the output did not end in calls); the Responses and
  Anthropic routes, streamed and not.
"""

from __future__ import annotations

import json
import random

import anthropic
import openai
import pytest
from conftest import start_server  # at import: another folder's conftest may hold the name later
from test_tool_calls_constrained import NAMES, TOOLS, _random_walk, _tag, check_calls, compiler  # noqa: F401

MODEL = "tiny-0-0"
BOOK = {"type": "function", "function": {"name": "book"}}


def _accumulate(deltas) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) of OpenAI delta dicts."""
    content, calls = "", {}
    for d in deltas:
        content += d.get("content") or ""
        for tc in d.get("tool_calls") or []:
            name, args = calls.get(tc["index"], (None, ""))
            calls[tc["index"]] = (tc["function"].get("name") or name, args + (tc["function"].get("arguments") or ""))
    return content, [calls[i] for i in sorted(calls)]


def _expected_split(text: str) -> tuple[int, str]:
    """(calls that ended, the cut call's text) of a grammar-held output."""
    ended = text.count("</tool_call>")
    return ended, text[text.rfind("</tool_call>") + len("</tool_call>"):].lstrip() if ended else text


def _streamed(parser, text: str, rng: random.Random) -> tuple[str, list[tuple[str, str]]]:
    stream, deltas, pos = parser.stream(), [], 0
    while pos < len(text):
        step = rng.randint(1, 6)
        deltas.append(stream.feed(text[pos:pos + step]))
        pos += step
    deltas.append(stream.finish())
    return _accumulate({"content": d.content, "tool_calls": d.tool_calls} for d in deltas)


# -- the parser alone --------------------------------------------------------------------------
@pytest.mark.parametrize("forced,parallel", [(None, True), (None, False), ("book", True)])
def test_every_cut_of_a_grammar_output_is_content_or_finished_calls(compiler, forced, parallel):
    from qv.server.parsers import Qwen3CoderToolParser

    tok, gc = compiler
    grammar, parser = _tag(compiler, TOOLS, forced, parallel), Qwen3CoderToolParser(TOOLS, forced=True)
    seed = random.randrange(1 << 30)  # fresh each run, named in every failure
    rng, walks = random.Random(seed), 0
    for _ in range(6):
        ids = _random_walk(grammar, gc.vocab_size, rng)
        if ids is None:
            continue
        walks += 1
        full = [(c.name, c.arguments) for c in parser.extract_tool_calls(tok.decode(ids)).tool_calls]
        check_calls(full, [forced] if forced else NAMES)
        for k in range(1, len(ids) + 1):
            text = tok.decode(ids[:k])
            got = parser.extract_tool_calls(text)
            calls = [(c.name, c.arguments) for c in got.tool_calls]
            assert _streamed(parser, text, rng) == (got.content or "", calls), (seed, text)
            ended, cut = _expected_split(text)
            assert (calls, got.content) == (full[:ended], cut or None), (seed, text)
    assert walks >= 5


# -- through the API ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def running(tiny_model):
    """Room for the five tools' prompt (about 1,700 tiny-tokenizer tokens) and the calls."""
    running, stop = start_server(tiny_model, max_model_len=4096)
    yield running
    stop()


@pytest.fixture(scope="module")
def client(running):
    return openai.OpenAI(base_url=running.v1, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def _chat(client, stream: bool, seed: int, **kw) -> tuple[str, list[tuple[str, str]], str, int]:
    """(content, [(name, arguments)], finish_reason, completion tokens), streamed or not."""
    args = dict(dict(model=MODEL, messages=[{"role": "user", "content": f"call something {seed}"}], tools=TOOLS,
                     seed=seed, temperature=1.0), **kw)
    if not stream:
        r = client.chat.completions.create(**args)
        c = r.choices[0]
        calls = [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
        return c.message.content or "", calls, c.finish_reason, r.usage.completion_tokens
    deltas, finish, used = [], None, None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args):
        for ch in chunk.choices:
            deltas.append(ch.delta.model_dump())
            finish = ch.finish_reason or finish
        used = chunk.usage.completion_tokens if chunk.usage else used
    return *_accumulate(deltas), finish, used


@pytest.mark.parametrize("choice", [dict(tool_choice="required"), dict(tool_choice="required", parallel_tool_calls=False),
                                    dict(tool_choice=BOOK)], ids=["required", "one-required", "named"])
def test_max_tokens_inside_a_forced_call_gives_its_text_as_content(client, tokenizer, choice):
    seed = random.randrange(1 << 30)
    full = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"call something {seed}"}],
                                          tools=TOOLS, seed=seed, temperature=1.0, extra_body={"return_token_ids": True},
                                          **choice).choices[0]
    assert full.finish_reason == "tool_calls"
    full_calls = [(t.function.name, t.function.arguments) for t in full.message.tool_calls]
    check_calls(full_calls, ["book"] if "function" in str(choice["tool_choice"]) else NAMES)
    ids = full.model_extra["token_ids"]
    assert ids[-1] in tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])  # the calls, then an end token
    rng = random.Random(seed)
    cuts = sorted(set(rng.sample(range(1, len(ids) - 1), 5)) | {len(ids) - 1})
    for k in cuts:
        text = tokenizer.decode(ids[:k], skip_special_tokens=True)
        unstreamed = _chat(client, False, seed, max_tokens=k, **choice)
        assert _chat(client, True, seed, max_tokens=k, **choice) == unstreamed, (seed, k, text)
        content, calls, finish, used = unstreamed
        assert finish == "length" and used == k, (seed, k, unstreamed)
        ended, cut = _expected_split(text)
        assert (content, calls) == (cut, full_calls[:ended]), (seed, k, unstreamed)
    assert (content, calls) == ("", full_calls)  # the last cut: one token short, the end token


def test_calls_repeated_until_the_limit_keep_those_that_ended(client):
    """Greedy, the tiny model repeats calls until max_tokens: each ended call stays a call."""
    kw = dict(tool_choice="required", max_tokens=150, temperature=0.0)
    unstreamed = _chat(client, False, 0, **kw)
    assert _chat(client, True, 0, **kw) == unstreamed
    content, calls, finish, _ = unstreamed
    assert finish == "length" and calls and content.startswith("<tool_call>"), unstreamed
    check_calls(calls, NAMES)


def test_the_openai_sdk_reports_a_cut_forced_call_as_a_length_finish(client):
    strict = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "call book"}], tools=strict, tool_choice=BOOK,
              seed=random.randrange(1 << 30), temperature=1.0)
    full = client.chat.completions.parse(**kw)
    done = full.choices[0].message.tool_calls[0].function
    assert done.name == "book" and done.parsed_arguments == json.loads(done.arguments)
    short = full.usage.completion_tokens - 2  # the end token and the last of `</tool_call>` left out
    with pytest.raises(openai.LengthFinishReasonError) as unstreamed:
        client.chat.completions.parse(max_tokens=short, **kw)
    with pytest.raises(openai.LengthFinishReasonError) as streamed:
        with client.chat.completions.stream(max_tokens=short, **kw) as events:
            for _ in events:
                pass
    cut, snapshot = unstreamed.value.completion.choices[0].message, streamed.value.completion.choices[0].message
    assert not cut.tool_calls and cut.content.startswith("<tool_call>\n<function=book>\n<parameter=code>\n")
    assert not snapshot.tool_calls and snapshot.content == cut.content


def test_a_stop_string_inside_a_forced_call_gives_its_text_as_content(client):
    seed = random.randrange(1 << 30)
    kw = dict(tool_choice=BOOK, stop=["</parameter>"], max_tokens=200)
    unstreamed = _chat(client, False, seed, **kw)
    assert _chat(client, True, seed, **kw) == unstreamed, seed
    content, calls, finish, _ = unstreamed
    assert finish == "stop" and calls == [], (seed, unstreamed)
    assert content.startswith("<tool_call>\n<function=book>\n<parameter=") and content.endswith("\n"), (seed, unstreamed)


def test_a_stop_string_inside_a_later_call_keeps_the_ended_ones_and_finishes_stop(client):
    """Greedy, the tiny model repeats calls: the stop string (kept in the output) opens the second
    call, so the first one ended and the output did not end in calls: finish "stop", not "tool_calls"."""
    kw = dict(tool_choice="required", stop=["\n<tool_call>\n<function="], temperature=0.0, max_tokens=400,
              extra_body={"include_stop_str_in_output": True})
    unstreamed = _chat(client, False, 0, **kw)
    assert _chat(client, True, 0, **kw) == unstreamed
    content, calls, finish, _ = unstreamed
    assert (content, finish, len(calls)) == ("<tool_call>\n<function=", "stop", 1), unstreamed
    check_calls(calls, NAMES)


def test_the_responses_and_anthropic_routes_give_a_cut_forced_call_as_text(running):
    responses = openai.OpenAI(base_url=running.v1, api_key="unused", max_retries=0, timeout=300).responses
    tools = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
             for t in TOOLS]
    kw = dict(model=MODEL, input="call book", tools=tools, tool_choice={"type": "function", "name": "book"},
              max_output_tokens=24, temperature=0)
    r = responses.create(**kw)
    ends = [e for e in responses.create(stream=True, **kw) if e.type.startswith("response.") and
            e.type.split(".")[1] in ("completed", "incomplete", "failed")]  # the SDK's stream helper wants completed
    assert [e.type for e in ends] == ["response.incomplete"]
    streamed = ends[0].response
    for resp in (r, streamed):
        assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
        assert [item.type for item in resp.output] == ["message"], resp.output
        assert resp.output_text.startswith("<tool_call>\n<function=book>")
    assert streamed.output_text == r.output_text

    messages = anthropic.Anthropic(base_url=running.url, api_key="unused", max_retries=0, timeout=300).messages
    kw = dict(model=MODEL, max_tokens=24, messages=[{"role": "user", "content": "call book"}],
              tools=[{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS],
              tool_choice={"type": "tool", "name": "book"}, extra_body={"temperature": 0})
    m = messages.create(**kw)
    with messages.stream(**kw) as events:
        streamed = events.get_final_message()
    for msg in (m, streamed):
        assert msg.stop_reason == "max_tokens" and [b.type for b in msg.content] == ["text"], msg.content
        assert msg.content[0].text.startswith("<tool_call>\n<function=book>")
    assert streamed.content[0].text == m.content[0].text
