"""The Responses API's stored responses through the official openai client on the tiny model: `store`,
retrieve, delete, `previous_response_id` (the continued conversation gives the greedy tokens of the
same conversation sent whole, tool calls included), `background` with cancel (a queued response
cancelled frees its place), the store's byte bound, and `request_id` / `priority` as vLLM means them."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest
from conftest import start_server

from qv.server.responses_store import ResponseStore, StoredResponse

MODEL = "tiny"
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                          "required": ["city"]}}  # bounded: greedy, the tiny model's unbounded city never ends


@pytest.fixture(scope="module")
def running(tiny_model):
    # one seat: a stream that holds it keeps a background response queued, whatever the machine's speed
    srv, stop = start_server(tiny_model, 8192, served_model_name=MODEL, max_num_seqs=1)
    yield srv
    stop()


@pytest.fixture(scope="module")
def client(running):
    return openai.OpenAI(base_url=running.v1, api_key="unused", max_retries=0, timeout=120)


def _create(client, **kw):
    return client.responses.create(**dict({"model": MODEL, "max_output_tokens": 8, "temperature": 0}, **kw))


def test_a_stored_response_is_retrieved_and_deleted(client):
    r = _create(client, input="Say hi.")
    assert r.store is True  # the default while the store is on (OpenAI's)
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as err:
        _create(client, input="again", previous_response_id=r.id)
    assert err.value.body["param"] == "previous_response_id"
    unstored = _create(client, input="Say hi.", store=False)
    assert unstored.store is False and unstored.output_text == r.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_a_streamed_response_is_stored_as_it_ended(client):
    events = list(_create(client, input="Tell me a story.", stream=True))
    final = events[-1].response
    assert client.responses.retrieve(final.id).model_dump() == final.model_dump()


def _as_input(items) -> list[dict]:
    return [i.model_dump(exclude_none=True) for i in items]


def test_previous_response_id_continues_the_conversation(client):
    """Two turns through previous_response_id give the tokens of the same conversation sent whole;
    the first turn's instructions are not carried over (OpenAI's rule)."""
    first = _create(client, input="Name a colour.", instructions="You are terse.")
    second = _create(client, input=[{"role": "user", "content": "And another one?"}], previous_response_id=first.id)
    assert second.previous_response_id == first.id
    whole = [{"role": "user", "content": "Name a colour."}, *_as_input(first.output),
             {"role": "user", "content": "And another one?"}]
    alone = _create(client, input=whole, store=False)
    assert second.output_text == alone.output_text
    assert second.usage.input_tokens == alone.usage.input_tokens
    assert second.usage.input_tokens > first.usage.input_tokens
    third = _create(client, input="A third?", previous_response_id=second.id)  # the chain goes on
    whole3 = [*whole, *_as_input(second.output), {"role": "user", "content": "A third?"}]
    assert third.usage.input_tokens == _create(client, input=whole3, store=False).usage.input_tokens


def test_input_items_list_the_conversation_that_led_to_a_response(client):
    first = _create(client, input="Name a colour.")
    second = _create(client, input=[{"role": "user", "content": [{"type": "input_text", "text": "Another?"}]}],
                     previous_response_id=first.id)
    asc = list(client.responses.input_items.list(second.id, order="asc", limit=1))  # one a page, the SDK follows
    expected = [("message", "user", "Name a colour."), *[(o.type, getattr(o, "role", None), getattr(
        o, "content", [None])[0].text if o.type == "message" else None) for o in first.output],
        ("message", "user", "Another?")]
    got = [(i.type, getattr(i, "role", None), i.content[0].text if i.type == "message" else None) for i in asc]
    assert got == expected
    assert len({i.id for i in asc}) == len(asc) and all(i.id for i in asc)
    desc = client.responses.input_items.list(second.id)  # OpenAI's default order: newest first
    assert [i.id for i in desc.data] == [i.id for i in asc][::-1] and desc.has_more is False
    with pytest.raises(openai.BadRequestError):
        client.responses.input_items.list(second.id, limit=101)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_nope")


def test_a_tool_call_is_answered_through_previous_response_id(client):
    call = _create(client, input="Weather in Paris?", tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                   max_output_tokens=100)  # greedy, the tiny model repeats parallel calls until cut, and a cut one is text
    calls = [o for o in call.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    result = [{"type": "function_call_output", "call_id": calls[0].call_id, "output": json.dumps({"temp_c": 21})}]
    follow = _create(client, input=result, previous_response_id=call.id, tools=[WEATHER])
    whole = [{"role": "user", "content": "Weather in Paris?"}, *_as_input(call.output), *result]
    alone = _create(client, input=whole, tools=[WEATHER], store=False)
    assert follow.output_text == alone.output_text and follow.usage.input_tokens == alone.usage.input_tokens


def test_a_background_response_runs_and_is_retrieved(client):
    fg = _create(client, input="Say hi.", store=False)
    bg = _create(client, input="Say hi.", background=True)
    assert bg.background is True and bg.status in ("queued", "in_progress")
    for _ in range(600):
        got = client.responses.retrieve(bg.id)
        if got.status not in ("queued", "in_progress"):
            break
        threading.Event().wait(0.1)
    assert got.status == fg.status and got.output_text == fg.output_text
    with pytest.raises(openai.BadRequestError):  # it has ended
        client.responses.cancel(bg.id)
    with pytest.raises(openai.BadRequestError, match="synchronous"):
        client.responses.cancel(_create(client, input="x").id)


def test_a_queued_background_response_is_cancelled(running, client):
    """A stream holds the one seat, so the background response waits; cancel answers it `cancelled`,
    retrieve agrees, and its engine request is gone from the queue."""
    engine = running.app.state.qv.engine
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 8000, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", running.v1 + "/chat/completions", json=body, timeout=120) as holder:
        lines = holder.iter_lines()  # kept: a dropped iterator would close the stream
        next(lines)  # generating: the seat is taken
        bg = _create(client, input="Say hi.", background=True)
        for _ in range(600):
            if engine.stats().num_waiting == 1:
                break
            threading.Event().wait(0.05)
        assert client.responses.retrieve(bg.id).status == "queued"
        cancelled = client.responses.cancel(bg.id)
        assert cancelled.status == "cancelled" and client.responses.retrieve(bg.id).status == "cancelled"
        for _ in range(600):
            if engine.stats().num_waiting == 0:
                break
            threading.Event().wait(0.05)
        assert engine.stats().num_waiting == 0, "the cancelled response still waits in the engine"
        assert running.app.state.qv.unstarted == 0, "the cancelled response still holds its admission seat"
    with pytest.raises(openai.BadRequestError) as err:  # background needs the store
        _create(client, input="x", background=True, store=False)
    assert err.value.body["param"] == "background"


def test_request_id_and_priority(running, client):
    r = _create(client, input="hi", extra_body={"request_id": "resp_mine-1"})
    assert r.id == "resp_mine-1" and client.responses.retrieve("resp_mine-1").id == "resp_mine-1"
    with pytest.raises(openai.BadRequestError) as err:
        _create(client, input="hi", extra_body={"request_id": "resp_mine-1"})
    assert err.value.body["param"] == "request_id"
    with pytest.raises(openai.BadRequestError) as err:
        _create(client, input="hi", extra_body={"priority": 2})  # the server's policy is fcfs
    assert err.value.body["param"] == "priority" and "Priority scheduling is not enabled" in err.value.body["message"]


def test_without_a_store_nothing_is_kept(tiny_model):
    srv, stop = start_server(tiny_model, served_model_name=MODEL, responses_store_bytes=0)
    try:
        c = openai.OpenAI(base_url=srv.v1, api_key="unused", max_retries=0, timeout=120)
        r = _create(c, input="hi")
        assert r.store is False
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(r.id)
        with pytest.raises(openai.BadRequestError) as err:
            _create(c, input="hi", store=True)
        assert err.value.body["param"] == "store" and "responses_store_bytes" in err.value.body["message"]
    finally:
        stop()


def _entry(size: int, status: str = "completed") -> StoredResponse:
    return StoredResponse({"status": status, "output": []}, [], size)


def test_the_store_drops_the_oldest_finished_responses_past_its_bytes():
    store = ResponseStore(1000)
    store.put("a", _entry(400, "in_progress"))
    store.put("b", _entry(300))
    store.put("c", _entry(300))
    assert list(store.entries) == ["a", "b", "c"] and store.bytes == 1000
    store.put("d", _entry(200))  # over by 200: b goes (a is running and stays)
    assert list(store.entries) == ["a", "c", "d"] and store.bytes == 900
    assert not store.put("huge", _entry(1001)) and store.get("huge") is None
    store.entries["a"].response["status"] = "completed"
    store.put("e", _entry(500))  # 1400: a (finished now, the oldest) goes, and that is enough
    assert list(store.entries) == ["c", "d", "e"] and store.bytes == 1000
    store.put("d", _entry(100))  # replaced: counted once, now the newest
    assert list(store.entries) == ["c", "e", "d"] and store.bytes == 900
    assert store.delete("e") is not None and store.bytes == 400 and store.delete("e") is None
