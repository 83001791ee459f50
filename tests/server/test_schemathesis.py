"""A bounded schemathesis run against /openapi.json: requests generated from the document (valid
bodies and, in negative mode, bodies that break it) sent to a real server on the embedded model
(Clef head included, behind an API key). Every answer must be below 500: bad input is a 4xx.
Failures print the request as a curl command to reproduce."""

from __future__ import annotations

import pytest
import schemathesis
from conftest import start_server
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

KEY = "fuzz-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}
EXAMPLES = 20  # per operation: the whole run stays within about two minutes on 2 CPU cores


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory):
    from qv.model.tiny import make_embedded

    folder = make_embedded(tmp_path_factory.mktemp("fuzz") / "embedded")
    running, stop = start_server(folder, api_key=KEY, max_num_batched_tokens=256, prefix_caching=False,
                                 max_waiting=16)
    yield running
    stop()


@pytest.fixture(scope="module")
def api_schema(fuzzed):
    return schemathesis.openapi.from_url(fuzzed.url + "/openapi.json", headers=HEADERS)


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_no_server_errors(case, fuzzed):
    if case.operation.path == "/v1/chat/completions" or case.operation.path == "/v1/completions":
        body = case.body if isinstance(case.body, dict) else None
        if body is not None and isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 8:
            body["max_tokens"] = 8  # the run tests the server's answers, not long generations
    case.call_and_validate(base_url=fuzzed.url, headers=HEADERS, checks=[not_a_server_error], timeout=120)
