"""No 500 for bad input: lone surrogates, nesting far past any schema, numbers outside the float range,
loose JSON types and a body that never arrives whole each get a clear 4xx; and a 5xx never carries the
text of the exception behind it (that goes to the log, under the request id the client is given)."""

from __future__ import annotations

import json
import logging
import socket
import time

import httpx
import pytest

from conftest import start_server

CHAT, COMP, RESP = "/v1/chat/completions", "/v1/completions", "/v1/responses"
MSG = '[{"role": "user", "content": "hi"}]'


def _deep(depth: int, leaf: str = "1") -> str:
    return '{"a": ' * depth + leaf + "}" * depth


def _tool(parameters: str) -> str:
    return '[{"type": "function", "function": {"name": "f", "parameters": ' + parameters + "}}]"


# (id, path, raw JSON body, param or None, message fragment)
REFUSED = [
    ("surrogate_in_content", CHAT, '{"messages": [{"role": "user", "content": "a\\ud800b"}]}', None, "surrogate"),
    ("low_surrogate_in_content_part", CHAT,
     '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}', None, "surrogate"),
    ("surrogate_in_prompt", COMP, '{"prompt": "x\\udfff", "max_tokens": 2}', None, "surrogate"),
    ("surrogate_in_prompt_list", COMP, '{"prompt": ["ok", "\\ud83d"], "max_tokens": 2}', None, "surrogate"),
    ("surrogate_in_input", RESP, '{"input": "\\ud800", "max_output_tokens": 2}', None, "surrogate"),
    ("surrogate_in_tokenize", "/tokenize", '{"prompt": "\\ud800"}', None, "surrogate"),
    ("deep_template_kwargs", CHAT, '{"messages": ' + MSG + ', "chat_template_kwargs": ' + _deep(900) + "}", None,
     "nests deeper"),
    ("deep_template_kwargs_list", CHAT, '{"messages": ' + MSG + ', "chat_template_kwargs": {"a": ' + "[" * 900
     + "]" * 900 + "}}", None, "nests deeper"),
    ("deep_tool_parameters", CHAT, '{"messages": ' + MSG + ', "tools": ' + _tool(_deep(900)) + "}", None,
     "nests deeper"),
    ("deep_responses_tool", RESP, '{"input": "x", "tools": [{"type": "function", "name": "f", "parameters": '
     + _deep(900) + "}]}", None, "nests deeper"),
    ("deep_tokenize_kwargs", "/tokenize", '{"messages": ' + MSG + ', "chat_template_kwargs": ' + _deep(900) + "}",
     None, "nests deeper"),
    ("temperature_1e999", CHAT, '{"messages": ' + MSG + ', "temperature": 1e999}', "temperature", "float"),
    ("top_p_minus_1e999", COMP, '{"prompt": "x", "top_p": -1e999}', "top_p", "float"),
    ("max_tokens_1e999", CHAT, '{"messages": ' + MSG + ', "max_tokens": 1e999}', "max_tokens", "float"),
    ("kwargs_1e999", CHAT, '{"messages": ' + MSG + ', "chat_template_kwargs": {"x": [1, 1e999]}}',
     "chat_template_kwargs.x[1]", "float"),
    ("metadata_1e999", RESP, '{"input": "x", "metadata": {"m": -1e999}}', "metadata.m", "float"),
    ("long_decimal_overflows", CHAT, '{"messages": ' + MSG + ', "temperature": ' + "9" * 400 + ".0}",
     "temperature", "float"),
    ("temperature_past_fp32", COMP, '{"prompt": "x", "temperature": 1.7976931348623157e308}', "temperature",
     "finite 32-bit float"),
    ("repetition_penalty_past_fp32", CHAT, '{"messages": ' + MSG + ', "repetition_penalty": 1e39}',
     "repetition_penalty", "finite 32-bit float"),
    ("nan_literal", CHAT, '{"messages": ' + MSG + ', "top_p": NaN}', None, "NaN and Infinity"),
    ("infinity_literal", COMP, '{"prompt": "x", "temperature": -Infinity}', None, "NaN and Infinity"),
    ("stream_string", CHAT, '{"messages": ' + MSG + ', "stream": "true"}', "stream", "valid boolean"),
    ("stream_int", COMP, '{"prompt": "x", "stream": 1}', "stream", "valid boolean"),
    ("stream_responses", RESP, '{"input": "x", "stream": "yes"}', "stream", "valid boolean"),
    ("max_tokens_decimal", CHAT, '{"messages": ' + MSG + ', "max_tokens": 4.5}', "max_tokens", "valid integer"),
    ("max_tokens_float_integral", COMP, '{"prompt": "x", "max_tokens": 4.0}', "max_tokens", "valid integer"),
    ("max_tokens_string", CHAT, '{"messages": ' + MSG + ', "max_tokens": "4"}', "max_tokens", "valid integer"),
    ("max_tokens_bool", COMP, '{"prompt": "x", "max_tokens": true}', "max_tokens", "valid integer"),
    ("max_output_tokens_decimal", RESP, '{"input": "x", "max_output_tokens": 2.5}', "max_output_tokens",
     "valid integer"),
    ("n_string", CHAT, '{"messages": ' + MSG + ', "n": "2"}', "n", "valid integer"),
    ("temperature_string", COMP, '{"prompt": "x", "temperature": "0.5"}', "temperature", "valid number"),
    ("logprobs_string", CHAT, '{"messages": ' + MSG + ', "logprobs": "yes"}', "logprobs", "valid boolean"),
    ("invalid_utf8", CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', None, "not valid JSON"),
    ("utf8_encoded_surrogate", COMP, b'{"prompt": "\xed\xa0\x80"}', None, "not valid JSON"),
]


@pytest.mark.parametrize("name,path,raw,param,fragment", REFUSED, ids=[r[0] for r in REFUSED])
def test_refused_with_400(server, name, path, raw, param, fragment):
    body = raw if isinstance(raw, bytes) else raw.encode()
    r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "BadRequestError" and err["code"] == 400
    assert fragment in err["message"], err["message"]
    if param is not None:
        assert err["param"] == param, err


ACCEPTED = [  # the nearby inputs that are fine
    ("surrogate_pair", CHAT, '{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}], "max_tokens": 2}'),
    ("template_kwargs_150_deep", CHAT, '{"messages": ' + MSG + ', "max_tokens": 2, "chat_template_kwargs": '
     + _deep(150) + "}"),
    ("tool_parameters_40_deep", CHAT, '{"messages": ' + MSG + ', "max_tokens": 2, "tools": '  # rendered into the prompt
     + _tool('{"type": "object", "properties": {"x": ' + _deep(40) + "}}") + "}"),
    ("integer_temperature", COMP, '{"prompt": "x", "max_tokens": 2, "temperature": 1}'),
    ("fp32_max_temperature", COMP, '{"prompt": "x", "max_tokens": 2, "temperature": 3.4e38}'),
    ("stream_false", COMP, '{"prompt": "x", "max_tokens": 2, "stream": false}'),
]


@pytest.mark.parametrize("name,path,raw", ACCEPTED, ids=[a[0] for a in ACCEPTED])
def test_nearby_inputs_still_answer(server, name, path, raw):
    r = httpx.post(server.url + path, content=raw.encode(), headers={"content-type": "application/json"}, timeout=120)
    assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def patient(tiny_model):
    """A server with a short body-read timeout."""
    running, stop = start_server(tiny_model, body_read_timeout_s=1.0)
    yield running
    stop()


def _raw_post(url: str, head_length: int, chunks: list[bytes], gap_s: float) -> tuple[float, bytes]:
    """POST with Content-Length `head_length`, send `chunks` `gap_s` apart, then read the answer."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {head_length}\r\n\r\n".encode())
        t0 = time.monotonic()
        try:
            for chunk in chunks:
                sock.sendall(chunk)
                time.sleep(gap_s)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed before the drip ended
        data = b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            part = sock.recv(65536)
            if not part:
                break
            data += part
        return time.monotonic() - t0, data


@pytest.mark.parametrize("chunks,gap_s", [([b'{"prompt": "x"'], 0.0),  # shorter than its Content-Length
                                          ([b" "] * 30, 0.1)])  # a drip that would take 3 s
def test_body_read_timeout_gives_408(patient, chunks, gap_s):
    elapsed, data = _raw_post(patient.url, 200, chunks, gap_s)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), data[:300]
    assert json.loads(body)["error"]["type"] == "RequestTimeoutError"
    assert elapsed < 1.0 + 1.5, elapsed  # the timeout plus scheduling slack, never "forever"
    assert httpx.get(patient.url + "/health").status_code == 200


def test_a_body_within_the_timeout_is_served(patient):
    body = b'{"prompt": "x", "max_tokens": 2}'
    _, data = _raw_post(patient.url, len(body), [body[:10], body[10:]], 0.3)
    assert data.startswith(b"HTTP/1.1 200"), data[:300]


SECRET = "secret-internal-detail-7f3a"


def _boom(*args, **kwargs):
    raise RuntimeError(SECRET)


def test_500_bodies_carry_a_request_id_not_the_exception(patient, monkeypatch, caplog):
    """A bug is injected where the chat answer is built (non-streaming) and where each stream delta is
    built; the client sees a request id, the log has the exception under that id."""
    import qv.server.openai as chat_module

    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
    with caplog.at_level(logging.ERROR, logger="qv.server"):
        monkeypatch.setattr(chat_module, "chat_response", _boom)
        r = httpx.post(patient.v1 + "/chat/completions", json=body, timeout=60)
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert SECRET not in r.text and "RuntimeError" not in r.text
        assert err["type"] == "InternalServerError" and "request id req-" in err["message"]
        rid = r.headers["x-request-id"]
        assert rid in err["message"]
        assert any(rid in rec.getMessage() and rec.exc_info and SECRET in str(rec.exc_info[1]) for rec in caplog.records)

        monkeypatch.setattr(chat_module, "_delta", _boom)
        with httpx.stream("POST", patient.v1 + "/chat/completions", json=dict(body, stream=True), timeout=60) as s:
            lines = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        event = json.loads(lines[-2][6:])["error"]
        assert event["code"] == 500 and SECRET not in json.dumps(event) and "request id chatcmpl-" in event["message"]
    monkeypatch.undo()
    assert httpx.post(patient.v1 + "/chat/completions", json=body, timeout=60).status_code == 200
