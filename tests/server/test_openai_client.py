"""The official `openai` client against the real server on the tiny model, and greedy outputs through
the API equal to qv.LLM.generate on the same prompt."""

from __future__ import annotations

import json

import httpx
import pytest

from qv.engine.request import SamplingParams

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


def test_models_list(openai_client, server):
    models = openai_client.models.list()
    assert [m.id for m in models.data] == ["tiny-0-0"]
    assert models.data[0].owned_by == "qv"
    raw = httpx.get(server.v1 + "/models").json()
    assert raw["object"] == "list" and raw["models"][0]["name"] == "tiny-0-0"
    assert raw["data"][0]["max_model_len"] == 1024


def test_chat_non_streaming(openai_client):
    r = openai_client.chat.completions.create(model="tiny-0-0", messages=MESSAGES, max_tokens=12, temperature=0,
                                              extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_chat_streaming_with_usage(openai_client):
    kwargs = dict(model="tiny-0-0", messages=MESSAGES, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    whole = openai_client.chat.completions.create(**kwargs)
    chunks = list(openai_client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert all(c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert text == whole.choices[0].message.content


def test_chat_streaming_n2(openai_client):
    chunks = list(openai_client.chat.completions.create(
        model="tiny-0-0", messages=MESSAGES, max_tokens=5, n=2, temperature=0.9, seed=3, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    finals = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert roles == [0, 1] and chunks[0].choices[0].delta.role and chunks[1].choices[0].delta.role  # role chunks first
    assert finals == [0, 1] and chunks[-1].usage.completion_tokens == 10


def test_stop_strings_and_stop_token_ids(server):
    base = {"prompt": "Stop here", "max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    with server.client() as c:
        full = c.post("/v1/completions", json=base).json()["choices"][0]
        stop = full["text"][4:6]
        cut = c.post("/v1/completions", json=dict(base, stop=[stop])).json()["choices"][0]
        assert cut["finish_reason"] == "stop" and cut["stop_reason"] == stop
        assert cut["text"] == full["text"][:full["text"].index(stop)]
        with c.stream("POST", "/v1/completions", json=dict(base, stop=[stop], stream=True)) as r:
            chunks = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
        assert "".join(ch["choices"][0]["text"] for ch in chunks) == cut["text"]
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        tid = full["token_ids"][2]
        first = full["token_ids"].index(tid)
        by_id = c.post("/v1/completions", json=dict(base, stop_token_ids=[tid])).json()["choices"][0]
        assert by_id["finish_reason"] == "stop" and by_id["stop_reason"] == tid
        assert by_id["token_ids"] == full["token_ids"][:first + 1]


def test_completions_string_and_token_ids(openai_client, server):
    a = openai_client.completions.create(model="tiny-0-0", prompt="The quick brown fox", max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True, "return_token_ids": True})
    ids = httpx.post(server.url + "/tokenize", json={"prompt": "The quick brown fox"}).json()["tokens"]
    b = openai_client.completions.create(model="tiny-0-0", prompt=ids, max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert a.choices[0].text == b.choices[0].text and a.usage.prompt_tokens == len(ids) == b.usage.prompt_tokens
    assert len(a.choices[0].model_extra["token_ids"]) == 8
    both = openai_client.completions.create(model="tiny-0-0", prompt=[ids, [3, 4, 5]], max_tokens=4, temperature=0)
    assert [c.index for c in both.choices] == [0, 1]
    assert both.choices[0].text == a.choices[0].text[:len(both.choices[0].text)]


def test_completions_n2_seeded(openai_client):
    kw = dict(model="tiny-0-0", prompt="Once upon a time", max_tokens=6, n=2, temperature=1.0, seed=7,
              extra_body={"ignore_eos": True})
    r1, r2 = openai_client.completions.create(**kw), openai_client.completions.create(**kw)
    assert sorted(c.index for c in r1.choices) == [0, 1]
    assert [c.text for c in r1.choices] == [c.text for c in r2.choices]  # seeded: reproducible
    assert r1.choices[0].text != r1.choices[1].text  # but the two samples differ
    assert r1.usage.completion_tokens == 12


def test_completions_logprobs(openai_client):
    # token ids as keys: byte-level tokens that decode to the same text ("\ufffd") would collide
    r = openai_client.completions.create(model="tiny-0-0", prompt="Hello", max_tokens=5, temperature=0, logprobs=3,
                                         extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert val <= 0 and len(top) == 3 and tok in top and tok.startswith("token_id:")
        assert val == pytest.approx(max(top.values()), abs=1e-5)  # greedy: the sampled token is the top one


def test_completions_echo(openai_client):
    r = openai_client.completions.create(model="tiny-0-0", prompt="Echo me", max_tokens=3, temperature=0, echo=True,
                                         extra_body={"ignore_eos": True})
    plain = openai_client.completions.create(model="tiny-0-0", prompt="Echo me", max_tokens=3, temperature=0,
                                             extra_body={"ignore_eos": True})
    assert r.choices[0].text == "Echo me" + plain.choices[0].text
    chunks = list(openai_client.completions.create(model="tiny-0-0", prompt="Echo me", max_tokens=3, temperature=0,
                                                   echo=True, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text


def test_chat_logprobs(openai_client):
    r = openai_client.chat.completions.create(model="tiny-0-0", messages=MESSAGES, max_tokens=4, temperature=0,
                                              logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token


def test_responses(openai_client):
    r = openai_client.responses.create(model="tiny-0-0", input="Say hi.", max_output_tokens=6, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].type == "message" and r.output_text
    assert r.output[-1].status == "incomplete"  # OpenAI's: the item max_output_tokens cut
    assert r.usage.output_tokens == 6
    events = list(openai_client.responses.create(model="tiny-0-0", input="Say hi.", max_output_tokens=6,
                                                 temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].response.output_text == r.output_text
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert done[-1].status == "incomplete" and events[-1].response.output[-1].status == "incomplete"


def test_greedy_matches_offline_llm(openai_client, server, tiny_model):
    """The API and qv.LLM (vLLM's offline interface) produce the same greedy tokens."""
    from qv.llm import LLM

    llm = LLM(model=str(tiny_model), max_model_len=1024)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    offline = llm.generate("The engine schedules requests", params)[0].outputs[0]
    r = openai_client.completions.create(model="tiny-0-0", prompt="The engine schedules requests", max_tokens=16,
                                         temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == offline.token_ids
    assert r.choices[0].text == offline.text
    # chat: the prompt the server renders (via /tokenize), run offline, equals the chat answer
    ids = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    offline_chat = llm.generate({"prompt_token_ids": ids}, params)[0].outputs[0]
    chat = openai_client.chat.completions.create(model="tiny-0-0", messages=MESSAGES, max_tokens=16, temperature=0,
                                                 extra_body={"ignore_eos": True, "return_token_ids": True})
    assert chat.choices[0].model_extra["token_ids"] == offline_chat.token_ids
    assert chat.choices[0].message.content == offline_chat.text


def test_generation_config_defaults_apply(server):
    """Unset sampling fields come from generation_config.json (tiny: temperature 0.7, top_k 20): two
    unseeded default requests differ, while temperature 0 repeats."""
    body = {"prompt": "Sample", "max_tokens": 12, "ignore_eos": True, "n": 4}
    with server.client() as c:
        texts = [ch["text"] for ch in c.post("/v1/completions", json=body).json()["choices"]]
        assert len(set(texts)) > 1
        greedy = [ch["text"] for ch in c.post("/v1/completions", json=dict(body, temperature=0)).json()["choices"]]
        assert len(set(greedy)) == 1


def test_ops_endpoints(server):
    with server.client() as c:
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "ignore_eos": True}).status_code == 200
        assert c.get("/health").status_code == 200
        assert c.get("/version").json()["version"]
        tok = c.post("/tokenize", json={"prompt": "Привет 😀", "return_token_strs": True}).json()
        assert tok["count"] == len(tok["tokens"]) == len(tok["token_strs"]) and tok["max_model_len"] == 1024
        assert c.post("/detokenize", json={"tokens": tok["tokens"]}).json() == {"prompt": "Привет 😀"}
        chat = c.post("/tokenize", json={"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": True}}).json()
        text = c.post("/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"]
        assert text.endswith("<|im_start|>assistant\n<think>\n") and "Name a colour." in text
        metrics = c.get("/metrics").text
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                     "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total",
                     'vllm:request_success_total{engine="0",finished_reason="length"', "vllm:prefix_cache_queries_total",
                     "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_count",
                     "vllm:e2e_request_latency_seconds_count", "vllm:request_queue_time_seconds_count",
                     "vllm:request_prefill_time_seconds_count", "vllm:request_decode_time_seconds_count",
                     "vllm:request_inference_time_seconds_count", "vllm:request_time_per_output_token_seconds_count",
                     "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
                     "vllm:request_params_n_bucket", "vllm:request_params_max_tokens_bucket"):
            assert name in metrics, name
        assert json.loads(c.get("/v1/models").text)["data"]


def test_continue_final_message_with_echo(server):
    """The last assistant message is continued (not closed), and echo prepends it (vLLM's chat echo)."""
    msgs = MESSAGES + [{"role": "assistant", "content": "The colour is"}]
    body = {"messages": msgs, "continue_final_message": True, "add_generation_prompt": False, "max_tokens": 3,
            "temperature": 0, "ignore_eos": True}
    with server.client() as c:
        ids = c.post("/tokenize", json={k: body[k] for k in ("messages", "continue_final_message",
                                                             "add_generation_prompt")}).json()["tokens"]
        assert c.post("/detokenize", json={"tokens": ids}).json()["prompt"].endswith("The colour is")
        plain = c.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
        echoed = c.post("/v1/chat/completions", json=dict(body, echo=True)).json()["choices"][0]["message"]["content"]
    assert echoed == "The colour is" + plain


def test_skip_special_tokens(server):
    """The tiny model emits special tokens (e.g. <|image_pad|>) often: kept text is the full
    decode of the ids, skipped text drops exactly those tokens' text."""
    body = {"prompt": "Hello", "max_tokens": 24, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    with server.client() as c:
        keep = c.post("/v1/completions", json=dict(body, skip_special_tokens=False)).json()["choices"][0]
        skip = c.post("/v1/completions", json=body).json()["choices"][0]
        assert keep["token_ids"] == skip["token_ids"]
        assert keep["text"] == c.post("/detokenize", json={"tokens": keep["token_ids"]}).json()["prompt"]
    assert "<|" in keep["text"] and "<|" not in skip["text"]
