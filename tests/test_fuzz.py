"""The server fuzzed by schemathesis from its own OpenAPI description: valid and invalid requests,
every answer checked against the description, never a 5xx, the server alive afterwards."""

from __future__ import annotations

import os

import pytest

schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("fastapi")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.generation import GenerationMode  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)
from serving import setup_for  # noqa: E402
from test_server import Live  # noqa: E402

from forerun.server.run import build_service  # noqa: E402

# Cases per operation: a bounded number in the suite; FORERUN_FUZZ_CASES=2000 for the long run (docs/server.md).
CASES = int(os.environ.get("FORERUN_FUZZ_CASES", "40"))
CHECKS = (not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection)


@pytest.fixture(scope="module")
def fuzzed(gemma):
    srv = Live(build_service(setup_for(gemma, "ngram"), name="tiny", max_batch=4, max_tokens=16, calibrate=False))
    yield srv
    status, health = srv.request("GET", "/health")  # after every case: still up, engine alive
    srv.close()
    assert status == 200 and health["status"] == "ok"


@pytest.fixture(scope="module")
def served_schema(fuzzed):
    return schemathesis.openapi.from_url(fuzzed.url + "/openapi.json")


def test_openapi_schema_is_served(fuzzed):
    status, doc = fuzzed.request("GET", "/openapi.json")
    assert status == 200 and doc["openapi"].startswith("3.0")
    assert doc["components"]["schemas"]["CompletionRequest"]["properties"]["model"]["enum"] == ["tiny"]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"} <= set(doc["paths"])


POS, NEG = GenerationMode.POSITIVE, GenerationMode.NEGATIVE


@pytest.mark.parametrize("operation,mode", [
    ("POST /v1/completions", POS), ("POST /v1/completions", NEG), ("POST /v1/chat/completions", POS),
    ("POST /v1/chat/completions", NEG), ("GET /v1/models", POS), ("GET /health", POS)],
    ids=lambda v: v.value if isinstance(v, GenerationMode) else v)
def test_fuzzing_finds_no_server_error_and_no_answer_off_the_schema(served_schema, operation, mode):
    """Valid (positive) and invalid (negative) requests per operation (the GETs take no input)."""
    method, path = operation.split()
    op = served_schema[path][method]
    calls = []

    @given(case=op.as_strategy(generation_mode=mode))
    @settings(max_examples=CASES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def fuzz(case):
        calls.append(case.call_and_validate(checks=CHECKS, timeout=60).status_code)

    fuzz()
    assert calls
    if method == "POST" and mode is GenerationMode.NEGATIVE:
        assert all(400 <= c < 500 for c in calls), sorted(set(calls))
    elif method == "POST":
        assert any(c == 200 for c in calls), sorted(set(calls))
