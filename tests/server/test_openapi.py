"""/openapi.json and /docs on a real server (the embedded model, with its Clef head, behind an API
key under api_key_scope all), and GET /v1/models/{model} through the official openai client."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from conftest import start_server

from qv.clef.request import CLEF_MODEL_NAMES, SystemOneRequest
from qv.server import openapi, protocol
from qv.server.app import ROUTES

KEY = "sekret-key"
NAME = "org/qv-tiny"  # a served name with a slash, as Hugging Face ids have


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    from qv.model.tiny import make_embedded

    folder = make_embedded(tmp_path_factory.mktemp("openapi") / "embedded")
    running, stop = start_server(folder, api_key=KEY, api_key_scope="all", served_model_name=NAME, max_num_batched_tokens=256,
                                 prefix_caching=False)
    yield running
    stop()


def auth() -> dict:
    return {"Authorization": f"Bearer {KEY}"}


def test_document_is_valid_and_lists_every_route(keyed):
    from openapi_spec_validator import validate

    doc = httpx.get(keyed.url + "/openapi.json", headers=auth(), timeout=30).json()
    validate(doc)
    bodies = {"/v1/chat/completions": protocol.ChatCompletionRequest, "/v1/completions": protocol.CompletionRequest,
              "/v1/responses": protocol.ResponsesRequest, "/v1/systemone": SystemOneRequest,
              "/tokenize": protocol.TokenizeRequest, "/detokenize": protocol.DetokenizeRequest}
    schemas = doc["components"]["schemas"]
    for path, _, method in ROUTES:
        op = doc["paths"][openapi.openapi_path(path)][method.lower()]
        assert "200" in op["responses"] and "4XX" in op["responses"], path
        if path in bodies:
            ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
            schema = schemas[ref.rsplit("/", 1)[1]]
            model = bodies.pop(path)
            assert set(schema["properties"]) == set(model.model_fields), path
            required = {n for n, f in model.model_fields.items() if f.is_required()}
            assert required <= set(schema.get("required", [])), path
        else:
            assert "requestBody" not in op, path
        open_paths = ("/health", "/ping", "/", "/playground", "/static/{name}")  # probes; the playground's page
        assert ("security" in op) == (path not in open_paths), path
    assert not bodies, f"body routes missing from ROUTES: {sorted(bodies)}"
    served = {(openapi.openapi_path(p), m.lower()) for p, _, m in ROUTES}
    documented = {(p, m) for p, ops in doc["paths"].items() for m in ops}
    assert documented == served
    assert "logit_bias" in schemas["ChatCompletionRequest"]["properties"]
    assert "multipart/form-data" in doc["paths"]["/v1/systemone"]["post"]["requestBody"]["content"]


def test_a_documented_body_is_one_the_server_takes(keyed):
    """The document's own example of a minimal chat body, built from its required fields, is served."""
    doc = httpx.get(keyed.url + "/openapi.json", headers=auth(), timeout=30).json()
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert chat["required"] == ["messages"]
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "model": NAME}
    r = httpx.post(keyed.url + "/v1/chat/completions", json=body, headers=auth(), timeout=120)
    assert r.status_code == 200, r.text


def test_docs_page_inlines_the_document_and_lists_the_routes(keyed):
    r = httpx.get(keyed.url + "/docs", headers=auth(), timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    assert "swagger-ui-bundle.js" in page and "SwaggerUIBundle" in page
    for path, _, method in ROUTES:
        assert f"<code>{method} {openapi.openapi_path(path)}</code>" in page, path
    spec = re.search(r"spec: (\{.*\}), dom_id", page, re.S).group(1)
    assert "</" not in spec  # nothing in the inlined JSON can close the script
    assert json.loads(spec) == httpx.get(keyed.url + "/openapi.json", headers=auth(), timeout=30).json()


@pytest.mark.parametrize("path", ["/openapi.json", "/docs"])
def test_schema_and_docs_need_the_key(keyed, path):
    r = httpx.get(keyed.url + path, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == 401
    r = httpx.get(keyed.url + path, headers={"Authorization": "Bearer wrong"}, timeout=30)
    assert r.status_code == 401
    assert httpx.get(keyed.url + "/health", timeout=30).status_code == 200


def test_retrieve_model_with_the_openai_client(keyed):
    client = openai.OpenAI(base_url=keyed.v1, api_key=KEY, max_retries=0, timeout=60)
    listed = {m.id: m for m in client.models.list().data}
    model = client.models.retrieve(NAME)
    assert model.id == NAME and model.object == "model" and model.owned_by == "qv"
    assert model.model_dump() == listed[NAME].model_dump()
    for clef in CLEF_MODEL_NAMES:  # the Clef names answer when Clef is served
        assert client.models.retrieve(clef).id == clef
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("no-such-model")
    assert err.value.status_code == 404
    body = err.value.body
    assert body["message"] == "The model `no-such-model` does not exist." and body["param"] == "model"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed.v1, api_key="wrong", max_retries=0).models.retrieve(NAME)


def test_retrieve_without_clef_is_404_for_the_clef_names(server, openai_client):
    name = openai_client.models.list().data[0].id
    assert openai_client.models.retrieve(name).id == name
    for clef in CLEF_MODEL_NAMES:
        with pytest.raises(openai.NotFoundError):
            openai_client.models.retrieve(clef)
    r = httpx.get(server.v1 + "/models/", timeout=30)  # an empty name is no model
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
