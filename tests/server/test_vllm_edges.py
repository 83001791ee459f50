"""vLLM's edges on a real server behind an API key: the key's scope (vLLM's: /v1/*; probes, metrics
and /tokenize open), CORS under vLLM's default flags (the preflight and a simple cross-origin GET),
SageMaker's /ping and /invocations, every metric vLLM's Grafana dashboard queries (names read from
the copy of its queries in vllm_grafana_queries.txt) plus the iteration, cache-config, HTTP and
process metrics, and each vLLM request field either honoured with vLLM's meaning or refused by name."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import httpx
import pytest
from conftest import start_server
from prometheus_client.parser import text_string_to_metric_families

from qv.config import ConfigError, EngineConfig, string_list

KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
MSG = [{"role": "user", "content": "hi"}]
QUERIES = Path(__file__).with_name("vllm_grafana_queries.txt")


@pytest.fixture(scope="module")
def keyed(tiny_model):
    running, stop = start_server(tiny_model, api_key=KEY, served_model_name="edge")
    yield running
    stop()


def chat(**kw) -> dict:
    return dict({"messages": MSG, "max_tokens": 4, "temperature": 0}, **kw)


def post(running, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(running.url + path, json=body, headers=dict(AUTH, **(headers or {})), timeout=120)


# -- the API key's scope ------------------------------------------------------------------------

def test_the_key_guards_v1_and_the_engine_routes_only(keyed):
    for method, path, body in (("POST", "/v1/chat/completions", chat()), ("POST", "/v1/completions", {"prompt": "x"}),
                               ("GET", "/v1/models", None), ("POST", "/v1/systemone", {}),
                               ("POST", "/invocations", chat()), ("POST", "/reset_prefix_cache", None)):
        r = httpx.request(method, keyed.url + path, json=body, timeout=60)
        assert r.status_code == 401 and r.json()["error"]["code"] == 401, (path, r.text)
    for method, path, body in (("GET", "/health", None), ("GET", "/ping", None), ("POST", "/ping", None),
                               ("GET", "/metrics", None), ("GET", "/version", None),
                               ("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [104]}),
                               ("GET", "/openapi.json", None), ("GET", "/docs", None)):
        r = httpx.request(method, keyed.url + path, json=body, timeout=60)
        assert r.status_code == 200, (path, r.text)


def test_openapi_marks_what_the_key_guards(keyed):
    doc = httpx.get(keyed.url + "/openapi.json", timeout=30).json()
    assert "security" in doc["paths"]["/v1/chat/completions"]["post"]
    assert "security" in doc["paths"]["/invocations"]["post"]
    for path, method in (("/metrics", "get"), ("/tokenize", "post"), ("/ping", "post"), ("/health", "get")):
        assert "security" not in doc["paths"][path][method], path


# -- CORS ------------------------------------------------------------------------------------------

def test_cors_preflight_is_answered_without_the_key(keyed):
    r = httpx.options(keyed.url + "/v1/chat/completions", timeout=30, headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == "*"
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    assert "access-control-allow-credentials" not in r.headers  # vLLM's default: no credentials


def test_simple_cross_origin_requests_carry_the_cors_header(keyed):
    r = httpx.get(keyed.url + "/v1/models", headers=dict(AUTH, Origin="https://app.example"), timeout=30)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    r = httpx.get(keyed.url + "/v1/models", headers={"Origin": "https://app.example"}, timeout=30)
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "*"  # the page can read the 401
    r = httpx.get(keyed.url + "/v1/models", headers=AUTH, timeout=30)
    assert "access-control-allow-origin" not in r.headers  # not a cross-origin request


def test_cors_levers_take_vllms_json_lists_or_commas():
    assert string_list('["https://a.example", "https://b.example"]') == ["https://a.example", "https://b.example"]
    assert string_list("GET, POST") == ["GET", "POST"] and string_list("") == []
    cfg = EngineConfig(allowed_origins='["https://a.example"]', allow_credentials=True)
    assert string_list(cfg.allowed_origins) == ["https://a.example"] and cfg.allow_credentials
    for bad in ("[1]", '["a"', "[null]"):
        with pytest.raises(ConfigError, match="allowed_origins"):
            EngineConfig(allowed_origins=bad)


def _cors_app(**levers):
    """A bare Starlette route behind LazyCORS under `levers` (no engine: CORS needs none)."""
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    from qv.server.http_edges import LazyCORS

    app = Starlette(routes=[Route("/v1/x", lambda request: PlainTextResponse("ok"), methods=["GET", "POST"])])
    app.add_middleware(LazyCORS, cfg_ref={"cfg": EngineConfig(**levers)})
    return app


def test_cors_levers_restrict_origins_methods_and_allow_credentials():
    from starlette.testclient import TestClient

    client = TestClient(_cors_app(allowed_origins='["https://a.example"]', allowed_methods="GET",
                                  allowed_headers="authorization", allow_credentials=True))
    pre = {"Access-Control-Request-Method": "GET", "Access-Control-Request-Headers": "authorization"}
    r = client.options("/v1/x", headers=dict(pre, Origin="https://a.example"))
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://a.example"
    assert r.headers["access-control-allow-credentials"] == "true" and "POST" not in r.headers["access-control-allow-methods"]
    assert client.options("/v1/x", headers=dict(pre, Origin="https://evil.example")).status_code == 400
    assert client.options("/v1/x", headers=dict(pre, Origin="https://a.example",
                                                 **{"Access-Control-Request-Method": "POST"})).status_code == 400
    r = client.get("/v1/x", headers={"Origin": "https://evil.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers  # the browser withholds it
    r = TestClient(_cors_app(allowed_origins="")).get("/v1/x", headers={"Origin": "https://a.example"})
    assert "access-control-allow-origin" not in r.headers  # no origins: no CORS at all


# -- SageMaker --------------------------------------------------------------------------------------

def test_invocations_route_by_body_shape(keyed):
    r = post(keyed, "/invocations", chat())
    assert r.status_code == 200 and r.json()["object"] == "chat.completion", r.text
    r = post(keyed, "/invocations", {"prompt": "hello", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["object"] == "text_completion", r.text
    with httpx.stream("POST", keyed.url + "/invocations", json=chat(stream=True), headers=AUTH, timeout=120) as s:
        lines = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and json.loads(lines[0][6:])["object"] == "chat.completion.chunk"
    r = post(keyed, "/invocations", {"input": "hi"})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = post(keyed, "/invocations", {"messages": [], "max_tokens": 2})  # a chat body: the chat API's own 400
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


# -- metrics ----------------------------------------------------------------------------------------

def dashboard_metrics() -> dict[str, str]:
    """Family name -> Prometheus type of every `vllm:` series the dashboard's queries read."""
    out = {}
    for line in QUERIES.read_text().splitlines():
        if line.startswith("#"):
            continue
        for series in re.findall(r"vllm:[a-z0-9_:]+", line):
            for suffix, kind in (("_bucket", "histogram"), ("_sum", "histogram"), ("_count", "histogram"),
                                 ("_total", "counter")):
                if series.endswith(suffix):
                    out[series.removesuffix(suffix)] = kind
                    break
            else:
                out[series] = "gauge"
    return out


def families(running) -> dict:
    return {f.name: f for f in text_string_to_metric_families(httpx.get(running.url + "/metrics", timeout=30).text)}


def test_every_dashboard_metric_is_exported_with_vllms_type_and_labels(keyed):
    assert post(keyed, "/v1/chat/completions", chat(max_tokens=6, n=2, ignore_eos=True)).status_code == 200
    wanted = dashboard_metrics()
    assert len(wanted) == 17 and "vllm:time_per_output_token_seconds" in wanted
    have = families(keyed)
    for name, kind in sorted(wanted.items()):
        assert name in have, f"{name} is not exported"
        assert have[name].type == kind, (name, have[name].type)
        assert all(s.labels.get("model_name") == "edge" for s in have[name].samples), name
    success = [s for s in have["vllm:request_success"].samples if s.name.endswith("_total")]
    assert success and all("finished_reason" in s.labels for s in success)
    top = {s.labels.get("le"): s.value for s in have["vllm:request_max_num_generation_tokens"].samples
           if s.name.endswith("_bucket")}
    assert top["5.0"] < top["10.0"]  # n=2 x 6 tokens each: the most one sequence made is 6, not 12
    itl = {s.name: s.value for s in have["vllm:inter_token_latency_seconds"].samples}
    legacy = {s.name.replace("time_per_output_token", "inter_token_latency"): s.value
              for s in have["vllm:time_per_output_token_seconds"].samples}
    assert legacy["vllm:inter_token_latency_seconds_count"] == itl["vllm:inter_token_latency_seconds_count"] > 0


def test_iteration_cache_config_http_and_process_metrics(keyed):
    assert post(keyed, "/v1/completions", {"prompt": "hello there", "max_tokens": 3}).status_code == 200
    assert httpx.get(keyed.url + "/v1/models", timeout=30).status_code == 401
    have = families(keyed)
    it = have["vllm:iteration_tokens_total"]
    assert it.type == "histogram"
    count = next(s.value for s in it.samples if s.name.endswith("_count"))
    inf = next(s.value for s in it.samples if s.labels.get("le") == "+Inf")
    assert count == inf >= 3 and next(s.value for s in it.samples if s.name.endswith("_sum")) >= count
    info = have["vllm:cache_config_info"]
    assert info.type == "gauge"
    labels = info.samples[0].labels
    assert labels["block_size"] == "16" and labels["enable_prefix_caching"] == "True" and int(labels["num_gpu_blocks"])
    http = have["http_requests"]
    assert http.type == "counter"
    done = {s.labels["status"]: s.value for s in http.samples
            if s.labels.get("handler") == "/v1/completions" and s.labels["method"] == "POST" and s.name.endswith("_total")}
    assert done["2xx"] >= 1
    assert any(s.labels.get("status") == "4xx" and s.value for s in http.samples)  # the guard's 401 counts too
    assert have["http_request_duration_seconds"].type == "histogram"
    assert have["process_resident_memory_bytes"].samples[0].value > 0
    # what a soak reads (qv bench serve): the RSS split, the driver's device memory, compiles in steps (CPU: 0)
    assert have["qv:process_resident_anon_bytes"].samples[0].value > 0
    assert have["qv:device_memory_used_bytes"].samples[0].value == 0
    assert have["qv:kernel_compiles"].type == "counter" and have["qv:kernel_compiles"].samples[0].value == 0
    assert "process_cpu_seconds" in have and "python_info" in have


# -- request fields ---------------------------------------------------------------------------------

REFUSED = {
    "priority": 1,
    "mm_processor_kwargs": {"fps": 1},
    "logits_processors": ["my.module.Processor"],
    "vllm_xargs": {"boost": 2},
    "chat_template": "{{ messages[0].content }}",
}


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_fields_qv_cannot_honour_are_refused_by_name(keyed, field):
    r = post(keyed, "/v1/chat/completions", chat(**{field: REFUSED[field]}))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert field in err["message"] or err["param"] == field, err


def test_a_request_chat_template_renders_under_trust_request_chat_template(tiny_model):
    """vLLM's --trust-request-chat-template: the request's template renders (in transformers'
    Jinja sandbox); without the lever it is the 400 above."""
    from transformers import AutoTokenizer

    from qv.server.chat import render_chat
    from qv.server.errors import APIError
    from qv.server.protocol import ChatCompletionRequest

    tok = AutoTokenizer.from_pretrained(tiny_model)
    req = ChatCompletionRequest.model_validate(chat(chat_template="<<{{ messages[0]['content'] }}>>"))
    rendered = render_chat(tok, req, False, trust_template=True)
    assert rendered.text == "<<hi>>" and rendered.token_ids == tok.encode("<<hi>>", add_special_tokens=False)
    with pytest.raises(APIError) as refused:
        render_chat(tok, req, False)
    assert refused.value.param == "chat_template" and "trust-request-chat-template" in refused.value.message
    escape = ChatCompletionRequest.model_validate(chat(chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}"))
    with pytest.raises(APIError) as sandboxed:
        render_chat(tok, escape, False, trust_template=True)
    assert sandboxed.value.status == 400 and sandboxed.value.param == "messages"


def test_request_id_names_the_response_and_the_logs(keyed, caplog):
    caplog.set_level(logging.INFO, logger="qv.server")
    r = post(keyed, "/v1/chat/completions", chat(request_id="my-req-1"))
    assert r.status_code == 200 and r.json()["id"] == "chatcmpl-my-req-1"
    assert any("chatcmpl-my-req-1" in rec.getMessage() for rec in caplog.records)
    r = post(keyed, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "request_id": "c-7"},
             headers={"X-Request-Id": "from-header"})  # vLLM's order: the header wins
    assert r.status_code == 200 and r.json()["id"] == "cmpl-from-header"
    r = post(keyed, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "request_id": "c-7"})
    assert r.json()["id"] == "cmpl-c-7"
    r = post(keyed, "/v1/completions", {"prompt": "hi", "max_tokens": 2}, headers={"X-Request-Id": "x" * 257})
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_id"
    assert post(keyed, "/v1/chat/completions", chat(request_id="")).json()["error"]["param"] == "request_id"
    assert post(keyed, "/v1/chat/completions", chat(priority=0)).status_code == 200  # the one priority qv has


def test_chat_add_special_tokens(keyed, tiny_model):
    """vLLM's chat `add_special_tokens`: the tokenizer's own special tokens around the rendered chat.
    The tiny tokenizer adds none, so the rule is shown on it given a BOS post-processor, and through
    the API as the tokenizer's own encoding of the rendered text."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    from qv.server.chat import render_chat
    from qv.server.protocol import ChatCompletionRequest

    tok = AutoTokenizer.from_pretrained(tiny_model)
    plain = post(keyed, "/v1/chat/completions", chat(return_token_ids=True)).json()["prompt_token_ids"]
    added = post(keyed, "/v1/chat/completions", chat(return_token_ids=True, add_special_tokens=True)).json()
    assert added["prompt_token_ids"] == tok.encode(tok.decode(plain), add_special_tokens=True)
    bos = "<|endoftext|>"
    tok.backend_tokenizer.post_processor = TemplateProcessing(single=f"{bos} $A",
                                                              special_tokens=[(bos, tok.convert_tokens_to_ids(bos))])
    off = render_chat(tok, ChatCompletionRequest.model_validate(chat()), False).token_ids
    on = render_chat(tok, ChatCompletionRequest.model_validate(chat(add_special_tokens=True)), False).token_ids
    assert on == [tok.convert_tokens_to_ids(bos)] + off


def test_spaces_between_special_tokens_is_the_fast_tokenizers_no_op(keyed, tiny_model):
    """vLLM decodes fast tokenizers (the only kind qv loads) with DecodeStream, which has no such
    option: both values give the same text there, and here."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    ids = tok.encode("a<|im_start|><|im_end|>b")
    assert tok.decode(ids, spaces_between_special_tokens=True) == tok.decode(ids, spaces_between_special_tokens=False)
    texts = {post(keyed, "/v1/completions", {"prompt": "hi", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                                             "skip_special_tokens": False, "spaces_between_special_tokens": flag}
                  ).json()["choices"][0]["text"] for flag in (True, False)}
    assert len(texts) == 1


def test_truncate_prompt_tokens_minus_one_keeps_up_to_max_model_len(keyed):
    ids = list(range(100, 140))
    body = {"prompt": ids, "max_tokens": 1, "return_token_ids": True}
    whole = post(keyed, "/v1/completions", dict(body, truncate_prompt_tokens=-1)).json()["choices"][0]
    assert whole["prompt_token_ids"] == ids  # 40 tokens fit in max_model_len 1024: nothing is cut
    last = post(keyed, "/v1/completions", dict(body, truncate_prompt_tokens=5)).json()["choices"][0]
    assert last["prompt_token_ids"] == ids[-5:]
    long = [100 + i % 200 for i in range(1100)]
    r = post(keyed, "/v1/completions", dict(body, prompt=long, truncate_prompt_tokens=-1))
    assert r.status_code == 400 and "contains 1024 input tokens" in r.json()["error"]["message"]  # cut, no room left
    r = post(keyed, "/v1/completions", dict(body, truncate_prompt_tokens=0))
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


def test_structural_tag_constrains_the_output(keyed):
    tag = {"type": "structural_tag",
           "format": {"type": "tag", "begin": "<x>", "content": {"type": "const_string", "value": "yes"}, "end": "</x>"}}
    r = post(keyed, "/v1/chat/completions", chat(max_tokens=40, response_format=tag))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "<x>yes</x>"
    legacy = {"structural_tag": json.dumps({"structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}],
                                            "triggers": ["<f>"]})}
    assert post(keyed, "/v1/completions", {"prompt": "hi", "max_tokens": 4, "structured_outputs": legacy}).status_code == 200
    r = post(keyed, "/v1/chat/completions", chat(response_format={"type": "structural_tag", "structures": []}))
    assert r.status_code == 400 and "structural tag" in r.json()["error"]["message"]


# -- the issue's fields, each sent once: honoured with vLLM's meaning, or a 400 naming it ---------------

@pytest.fixture(scope="module")
def lenient(tiny_model):
    """The levers that turn two refusals into vLLM's behaviour: priority scheduling, trusted templates."""
    running, stop = start_server(tiny_model, served_model_name="edge", scheduling_policy="priority",
                                 trust_request_chat_template=True)
    yield running
    stop()


def _field_cases(tok) -> dict:
    """field -> (route, body, check of an honoured answer's JSON)."""
    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<x>", "end": "</x>",
                                                "content": {"type": "const_string", "value": "yes"}}}
    ids = list(range(100, 140))
    return {
        "request_id": ("/v1/chat/completions", chat(request_id="audit-1"), lambda b: b["id"] == "chatcmpl-audit-1"),
        "priority": ("/v1/chat/completions", chat(priority=-3), lambda b: b["choices"][0]["message"] is not None),
        "mm_processor_kwargs": ("/v1/chat/completions", chat(mm_processor_kwargs={"fps": 1}), None),
        "add_special_tokens": ("/v1/chat/completions", chat(add_special_tokens=True, return_token_ids=True),
                               lambda b: b["prompt_token_ids"] == tok.encode(tok.decode(b["prompt_token_ids"]),
                                                                              add_special_tokens=True)),
        "logits_processors": ("/v1/chat/completions", chat(logits_processors=["my.module.Processor"]), None),
        "vllm_xargs": ("/v1/chat/completions", chat(vllm_xargs={"boost": 2}), None),
        "spaces_between_special_tokens": (
            "/v1/completions", {"prompt": "hi", "max_tokens": 4, "temperature": 0,
                                "spaces_between_special_tokens": False}, lambda b: b["choices"][0]["text"] is not None),
        "truncate_prompt_tokens": ("/v1/completions", {"prompt": ids, "max_tokens": 1, "return_token_ids": True,
                                                       "truncate_prompt_tokens": -1},
                                   lambda b: b["choices"][0]["prompt_token_ids"] == ids),
        "structural_tag": ("/v1/chat/completions", chat(max_tokens=40, response_format=tag),
                           lambda b: b["choices"][0]["message"]["content"] == "<x>yes</x>"),
        "chat_template": ("/v1/chat/completions", chat(chat_template="<<{{ messages[0]['content'] }}>>",
                                                       return_token_ids=True),
                          lambda b: b["prompt_token_ids"] == tok.encode("<<hi>>", add_special_tokens=False)),
    }


REFUSED_WITHOUT_LEVERS = {"priority", "chat_template", "mm_processor_kwargs", "logits_processors", "vllm_xargs"}
REFUSED_ALWAYS = {"mm_processor_kwargs", "logits_processors", "vllm_xargs"}  # vLLM's plug-in hooks


@pytest.mark.parametrize("levers", ["default", "priority+trusted"])
def test_each_field_of_the_issue_is_honoured_or_refused_by_name(keyed, lenient, tiny_model, levers):
    """Issue 37's fields, each sent once under qv's default levers and under scheduling_policy priority
    with trust_request_chat_template: a 400 naming it where qv refuses it, else a 200 whose body shows
    vLLM's meaning. No field is accepted and ignored."""
    from transformers import AutoTokenizer

    running = keyed if levers == "default" else lenient
    refused = REFUSED_WITHOUT_LEVERS if levers == "default" else REFUSED_ALWAYS
    outcome = {}
    for field, (route, body, honoured) in _field_cases(AutoTokenizer.from_pretrained(tiny_model)).items():
        r = post(running, route, body)
        if r.status_code == 400:
            err = r.json()["error"]
            assert field in err["message"] or err["param"] == field, (field, err)
            outcome[field] = "refused"
        else:
            assert r.status_code == 200 and honoured is not None and honoured(r.json()), (field, r.text[:300])
            outcome[field] = "honoured"
    assert {f for f, o in outcome.items() if o == "refused"} == refused, outcome
