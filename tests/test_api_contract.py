"""The API against its own contract: schemathesis generates requests from `/openapi.json`
for every operation and checks each answer in-process (WSGI) against the real app on real
Postgres and Redis: no 5xx, documented status codes and content types, bodies matching the
documented schemas. Plus the document itself, `/docs` offline, and the error shape.
"""

from __future__ import annotations

import hypothesis
import pytest
import schemathesis
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from webapp import create_app
from webapp.openapi import OPERATIONS, build_openapi

pytestmark = pytest.mark.integration

EXAMPLES_PER_OPERATION = 60  # 27 operations: > 1,600 generated cases in all
CASES: list[str] = []


@pytest.fixture(scope="module")
def contract_app(service_settings, tiny_qwen3_dir):
    # NOTE: the served model's name is one generated strings never hit, so no generated
    # request reaches a worker that does not run here (a valid OpenAI stream would wait
    # for tokens forever); validation, which runs before the model lookup, is fuzzed whole.
    settings = service_settings.with_overrides(
        models={"contract-model-7f3a": str(tiny_qwen3_dir)}, request_timeout_seconds=0.5)
    app = create_app(settings)
    yield app
    app.extensions["llmq"].close()


@pytest.fixture(scope="module")
def api_schema(contract_app):
    return schemathesis.openapi.from_wsgi("/openapi.json", contract_app)


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@hypothesis.settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True,
                     suppress_health_check=list(hypothesis.HealthCheck))
def test_every_operation_keeps_its_contract(case):
    CASES.append(f"{case.method} {case.path}")
    checks = [status_code_conformance, content_type_conformance, response_schema_conformance]
    # NOTE: /ready answers a documented 503 here by design (no worker runs in this test);
    # every other operation must never answer a 5xx.
    if case.path != "/ready":
        checks.append(not_a_server_error)
    case.call_and_validate(checks=checks)


def test_the_fuzz_ran_over_a_thousand_cases_on_every_operation():
    if not CASES:
        pytest.skip("run with the parametrized fuzz above")
    operations = {f"{op.method.upper()} {op.path}" for op in OPERATIONS}
    assert operations <= set(CASES)
    documented = [case for case in CASES if case in operations]
    print(f"{len(documented)} generated cases over {len(operations)} operations")
    assert len(documented) >= 1000, len(documented)


def test_the_document_is_valid_openapi_3_1_and_describes_streams():
    from openapi_spec_validator import validate

    document = build_openapi()
    validate(document)
    assert document["openapi"] == "3.1.0"
    completions = document["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]
    assert set(completions) == {"application/json", "text/event-stream"}
    events = document["paths"]["/v1/jobs/{job_id}/events"]["get"]["responses"]["200"]
    assert set(events["content"]) == {"text/event-stream"}
    request = document["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    for vllm_field in ("top_k", "min_p", "repetition_penalty", "stop_token_ids", "min_tokens",
                       "ignore_eos", "priority"):
        assert vllm_field in request
    listing = document["paths"]["/v1/jobs"]["get"]["parameters"]
    assert {p["name"] for p in listing if p["in"] == "query"} == {
        "limit", "after", "status", "model", "created_after", "created_before", "batch_id"}
    for path, item in document["paths"].items():  # X-Request-Id in, and out of, all
        for operation in item.values():
            assert "X-Request-Id" in {p["name"] for p in operation["parameters"]}, path
            for answer in operation["responses"].values():
                assert "X-Request-Id" in answer["headers"], path
    for path in ("/tokenize", "/detokenize", "/version"):
        assert path in document["paths"]
    assert {"root", "max_model_len"} <= set(document["components"]["schemas"]["Model"][
        "properties"])
    upload = document["paths"]["/v1/files"]["post"]["requestBody"]["content"]
    assert set(upload) == {"multipart/form-data"}


def test_docs_page_and_its_assets_are_served_from_the_package(contract_app):
    client = contract_app.test_client()
    page = client.get("/docs")
    assert page.status_code == 200 and b"/docs/assets/swagger-ui-bundle.js" in page.data
    assert b"http" not in page.data.replace(b"http-equiv", b"")  # nothing from a CDN
    bundle = client.get("/docs/assets/swagger-ui-bundle.js")
    assert bundle.status_code == 200 and len(bundle.data) > 100_000
    assert client.get("/openapi.json").json["openapi"] == "3.1.0"
