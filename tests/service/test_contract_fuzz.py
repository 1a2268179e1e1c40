"""The OpenAPI contract holds under a fuzzer: schemathesis generates requests for every operation of
``openapi.json`` (valid and invalid bodies, parameters at their bounds, odd Unicode) against a live
``moelab serve`` with an API token, and checks every answer: no server error, each status code documented
for its operation, each body in the documented shape (errors included: ``{"detail": str}``, 422 with its
``errors`` list). Bounded and derandomised, so a run takes a minute or two and fails the same way twice."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance, status_code_conformance

from backend.openapi import TARGET

from .conftest import _free_port
from .helpers import env_for

TOKEN = "fuzz-token-0123456789"
CHECKS = [not_a_server_error, status_code_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def fuzzed_serve(service_config, tmp_path_factory) -> Iterator[str]:
    """``moelab serve`` with a token, on free ports, sharing the service fixtures' store and Redis DB."""
    from tests.frontend.conftest import _spawn, _stop, _wait_http

    logs = tmp_path_factory.mktemp("fuzz-logs")
    port, ui_port = _free_port(), _free_port()
    env = env_for(service_config, MOELAB_HOST="127.0.0.1", MOELAB_PORT=str(port), MOELAB_FRONTEND_PORT=str(ui_port),
                  MOELAB_API_TOKEN=TOKEN)
    env.pop("MOELAB_API_URL", None)
    serve = _spawn([sys.executable, "-m", "moelab.cli", "serve"], env, logs / "serve.log")
    try:
        _wait_http(f"http://127.0.0.1:{port}/api/v1/health", serve, logs / "serve.log", 90)
        yield f"http://127.0.0.1:{port}"
    finally:
        _stop(serve)


#: the committed contract (test_openapi: it is the app's own); requests go to the live serve
schema = schemathesis.openapi.from_dict(json.loads(TARGET.read_text(encoding="utf-8")))


@schema.parametrize()
@settings(max_examples=6, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
def test_every_operation_keeps_its_contract(case, fuzzed_serve):
    # GET /tasks?registry=true indexes lm-eval's thousands of tasks on its first call (10-18 s on 2 busy cores): slow
    # once, not a broken contract, so a longer wait than schemathesis' 10 s
    case.call_and_validate(base_url=fuzzed_serve, headers={"Authorization": f"Bearer {TOKEN}"}, checks=CHECKS, timeout=60)


@schema.parametrize()
@settings(max_examples=1, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
def test_every_operation_without_the_token_is_a_documented_401(case, fuzzed_serve):
    response = case.call_and_validate(base_url=fuzzed_serve, checks=CHECKS)
    if case.path != "/api/v1/health" and response.request.method != "OPTIONS":  # OPTIONS (CORS preflight) passes the gate: 405
        assert response.status_code == 401 and "MOELAB_API_TOKEN" in response.json()["detail"]
