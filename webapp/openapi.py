"""The API's description: `/openapi.json` (OpenAPI 3.1, generated from the pydantic models
of `tasks.api`) and `/docs` (Swagger UI, its assets served from the `flask_swagger_ui`
package: no CDN, works offline).

Each operation is one row of `OPERATIONS`: its request body model, query model, headers
and the models of its answers by status. Every operation takes an `X-Request-Id` header
and every answer carries one (`webapp/request_id.py`); a malformed one is a 400, so
every operation documents a 400. The schemas are pydantic's
`models_json_schema()` (JSON Schema 2020-12, which OpenAPI 3.1 uses as it is).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flask import Blueprint, Response, current_app, jsonify, send_from_directory
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from tasks.api import responses as responses_api
from tasks.api.batches import Batch, BatchCreateRequest, BatchList, BatchListQuery
from tasks.api.errors import ErrorResponse
from tasks.api.files import FileDeleted, FileList, FileListQuery, FileObject, FileUpload
from tasks.api.jobs import Job, JobCreateRequest, JobList, JobListQuery
from tasks.api.openai import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ModelList,
)
from tasks.api.service import Health, Readiness
from tasks.api.tokens import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    Version,
)
from webapp.request_id import HEADER as REQUEST_ID_HEADER
from webapp.request_id import MAX_REQUEST_ID_CHARS
from webapp.tokens import package_version

bp = Blueprint("openapi", __name__)

SSE = "text/event-stream"
JSON = "application/json"
MULTIPART = "multipart/form-data"
_REF = "#/components/schemas/{model}"


@dataclass(frozen=True, slots=True)
class Param:
    name: str
    where: str  # path, query, header
    description: str
    required: bool = False
    schema: dict[str, Any] = field(default_factory=lambda: {"type": "string"})


@dataclass(frozen=True, slots=True)
class Operation:
    method: str
    path: str
    operation_id: str
    summary: str
    tag: str
    # status -> {media type: model, or None for free text}
    responses: dict[int, dict[str, type[BaseModel] | None]]
    body: type[BaseModel] | None = None
    body_media: str = JSON  # the request body's media type
    query: type[BaseModel] | None = None
    params: tuple[Param, ...] = ()


def _errors(*statuses: int) -> dict[int, dict[str, type[BaseModel] | None]]:
    return {status: {JSON: ErrorResponse} for status in statuses}


JOB_ID = Param("job_id", "path", "the job's id (UUID)", required=True)
IDEMPOTENCY_KEY = Param("Idempotency-Key", "header", "1 to 200 characters: a retry with the "
                        "same key and request returns the first job; the same key with a "
                        "different request is a 422",
                        schema={"type": "string", "minLength": 1, "maxLength": 200})
RESPONSE_ID = Param("response_id", "path", "the response's id (resp_<hex>)", required=True)
_OPENAI_ERRORS = _errors(400, 401, 404, 413, 422, 429, 500, 503, 504)
REQUEST_ID = Param(REQUEST_ID_HEADER, "header", f"1 to {MAX_REQUEST_ID_CHARS} printable "
                   "ASCII characters, echoed in the answer and stored on a created job; "
                   "without it the server makes one (req_<32 hex>)",
                   schema={"type": "string", "minLength": 1,
                           "maxLength": MAX_REQUEST_ID_CHARS,
                           "pattern": "^[!-~]([ -~]*[!-~])?$"})
FILE_ID = Param("file_id", "path", "the file's id (file-...)", required=True)
BATCH_ID = Param("batch_id", "path", "the batch's id (batch_...)", required=True)

OPERATIONS: tuple[Operation, ...] = (
    Operation("post", "/v1/jobs", "createJob", "Submit a job (202); a repeated "
              "Idempotency-Key returns the first job (200)", "jobs",
              {202: {JSON: Job}, 200: {JSON: Job}, **_errors(400, 401, 404, 413, 422, 429, 503)},
              body=JobCreateRequest, params=(IDEMPOTENCY_KEY,)),
    Operation("get", "/v1/jobs", "listJobs", "The caller's jobs, newest first; page with "
              "`after` (the previous page's `last_id`)", "jobs",
              {200: {JSON: JobList}, **_errors(400, 401, 503)}, query=JobListQuery),
    Operation("get", "/v1/jobs/{job_id}", "getJob", "A job: status, output so far, usage",
              "jobs", {200: {JSON: Job}, **_errors(401, 404, 503)}, params=(JOB_ID,)),
    Operation("post", "/v1/jobs/{job_id}/cancel", "cancelJob", "Cancel: a queued job at once "
              "(200), a running one by asking its worker (202); 409 when it already ended",
              "jobs", {200: {JSON: Job}, 202: {JSON: Job}, **_errors(401, 404, 409, 503)},
              params=(JOB_ID,)),
    Operation("get", "/v1/jobs/{job_id}/events", "streamJobEvents", "Server-sent events of "
              "the job: `token`, `restart`, then one of `done`, `error`, `cancelled`", "jobs",
              {200: {SSE: None}, **_errors(400, 401, 404, 503)},
              params=(JOB_ID,
                      Param("Last-Event-ID", "header", "resume after this event id "
                            "(<ms>-<seq>)"),
                      Param("last_event_id", "query", "the same, for clients that cannot "
                            "set headers"))),
    Operation("post", "/v1/completions", "createCompletion", "OpenAI completions; "
              "`stream: true` answers text/event-stream chunks (the Completion shape) "
              "ending with `data: [DONE]`", "openai",
              {200: {JSON: Completion, SSE: None}, **_OPENAI_ERRORS},
              body=CompletionRequest, params=(IDEMPOTENCY_KEY,)),
    Operation("post", "/v1/chat/completions", "createChatCompletion", "OpenAI chat "
              "completions; `stream: true` answers text/event-stream chunks "
              "(ChatCompletionChunk) ending with `data: [DONE]`", "openai",
              {200: {JSON: ChatCompletion, SSE: None}, **_OPENAI_ERRORS},
              body=ChatCompletionRequest, params=(IDEMPOTENCY_KEY,)),
    Operation("post", "/v1/responses", "createResponse", "OpenAI Responses (text): "
              "`background: true` answers the queued response at once; `stream: true` "
              "answers text/event-stream events (ResponseStreamEvent) numbered by "
              "sequence_number",
              "responses", {200: {JSON: responses_api.Response, SSE: None}, **_OPENAI_ERRORS},
              body=responses_api.ResponseCreateRequest, params=(IDEMPOTENCY_KEY,)),
    Operation("get", "/v1/responses/{response_id}", "getResponse", "A response (output so "
              "far while it runs); `stream=true` replays its events after `starting_after` "
              "and follows them live", "responses",
              {200: {JSON: responses_api.Response, SSE: None}, **_errors(400, 401, 404, 503)},
              query=responses_api.ResponseRetrieveQuery, params=(RESPONSE_ID,)),
    Operation("get", "/v1/responses/{response_id}/input_items", "listInputItems", "The "
              "response's own input items; page with `after` (an item id)", "responses",
              {200: {JSON: responses_api.InputItemList}, **_errors(400, 401, 404, 503)},
              query=responses_api.InputItemListQuery, params=(RESPONSE_ID,)),
    Operation("post", "/v1/responses/{response_id}/cancel", "cancelResponse", "Cancel a "
              "background response; a finished one is answered as it is", "responses",
              {200: {JSON: responses_api.Response}, **_errors(400, 401, 404, 503)},
              params=(RESPONSE_ID,)),
    Operation("delete", "/v1/responses/{response_id}", "deleteResponse", "Delete a response "
              "(its job is cancelled if it still runs)", "responses",
              {200: {JSON: responses_api.ResponseDeleted}, **_errors(401, 404, 503)},
              params=(RESPONSE_ID,)),
    Operation("get", "/v1/models", "listModels", "Served models and their live device groups",
              "openai", {200: {JSON: ModelList}, **_errors(401, 503)}),
    Operation("post", "/tokenize", "tokenize", "vLLM's tokenize: the token ids of a prompt, "
              "or of a chat rendered with the model's template", "vllm",
              {200: {JSON: TokenizeResponse}, **_errors(400, 401, 404, 413, 503)},
              body=TokenizeRequest),
    Operation("post", "/detokenize", "detokenize", "vLLM's detokenize: the text of token ids "
              "(each below the model's vocab_size)", "vllm",
              {200: {JSON: DetokenizeResponse}, **_errors(400, 401, 404, 413, 503)},
              body=DetokenizeRequest),
    Operation("get", "/version", "version", "The llmq package's version", "service",
              {200: {JSON: Version}}),
    Operation("post", "/v1/files", "createFile", "Upload a file of batch requests "
              "(JSONL, at most LLMQ_MAX_FILE_BYTES), optionally expiring (`expires_after`)",
              "files",
              {200: {JSON: FileObject}, **_errors(400, 401, 413, 503)},
              body=FileUpload, body_media=MULTIPART),
    Operation("get", "/v1/files", "listFiles", "The caller's files; page with `after`",
              "files", {200: {JSON: FileList}, **_errors(400, 401, 503)}, query=FileListQuery),
    Operation("get", "/v1/files/{file_id}", "retrieveFile", "A file's description", "files",
              {200: {JSON: FileObject}, **_errors(401, 404, 503)}, params=(FILE_ID,)),
    Operation("get", "/v1/files/{file_id}/content", "downloadFile", "A file's bytes",
              "files", {200: {"application/octet-stream": None}, **_errors(401, 404, 503)},
              params=(FILE_ID,)),
    Operation("delete", "/v1/files/{file_id}", "deleteFile", "Delete a file (409 while an "
              "unfinished batch reads it)", "files",
              {200: {JSON: FileDeleted}, **_errors(401, 404, 409, 503)}, params=(FILE_ID,)),
    Operation("post", "/v1/batches", "createBatch", "Run every request of an uploaded file "
              "as a job, after interactive traffic: answers `validating` at once; a file "
              "with invalid lines then makes the batch `failed` (errors.data has their line "
              "numbers)", "batches",
              {200: {JSON: Batch}, **_errors(400, 401, 413, 503)}, body=BatchCreateRequest),
    Operation("get", "/v1/batches", "listBatches", "The caller's batches, newest first; page "
              "with `after`", "batches", {200: {JSON: BatchList}, **_errors(400, 401, 503)},
              query=BatchListQuery),
    Operation("get", "/v1/batches/{batch_id}", "retrieveBatch", "A batch: status, request "
              "counts, output and error files", "batches",
              {200: {JSON: Batch}, **_errors(401, 404, 503)}, params=(BATCH_ID,)),
    Operation("post", "/v1/batches/{batch_id}/cancel", "cancelBatch", "Cancel: `cancelling`, "
              "then `cancelled` with the finished requests in the output file; 409 when it "
              "already ended otherwise", "batches",
              {200: {JSON: Batch}, **_errors(401, 404, 409, 503)}, params=(BATCH_ID,)),
    Operation("get", "/health", "health", "Liveness", "service", {200: {JSON: Health}}),
    Operation("get", "/ready", "ready", "Readiness: database, Redis and a live worker per "
              "model", "service", {200: {JSON: Readiness}, 503: {JSON: Readiness}}),
    Operation("get", "/metrics", "metrics", "Prometheus metrics", "service",
              {200: {"text/plain": None}}),
)
# documented in components though no operation names them directly (stream chunks)
EXTRA_MODELS: tuple[type[BaseModel], ...] = (ChatCompletionChunk, ErrorResponse,
                                             responses_api.ResponseStreamEvent)


def build_openapi(version: str | None = None) -> dict[str, Any]:
    """The OpenAPI 3.1 document of `OPERATIONS` (`version`: the package's by default)."""
    models: list[type[BaseModel]] = list(EXTRA_MODELS)
    for op in OPERATIONS:
        if op.body is not None:
            models.append(op.body)
        for media in op.responses.values():
            models.extend(model for model in media.values() if model is not None)
    unique = list(dict.fromkeys(models))
    refs, defs = models_json_schema([(model, "validation") for model in unique],
                                    ref_template=_REF)
    schemas = dict(defs.get("$defs", {}))
    paths: dict[str, dict[str, Any]] = {}
    for op in OPERATIONS:
        paths.setdefault(op.path, {})[op.method] = _operation(op, refs)
    return {
        "openapi": "3.1.0",
        "info": {"title": "llmq", "version": version or package_version(),
                 "description": "LLM completions as durable asynchronous jobs: the jobs API "
                 "and OpenAI's completions and chat completions over the same jobs. Errors "
                 "are OpenAI's shape: {\"error\": {type, message, param, code}}."},
        "tags": [{"name": "jobs"}, {"name": "openai"}, {"name": "responses"},
                 {"name": "files"}, {"name": "batches"}, {"name": "vllm"},
                 {"name": "service"}],
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                           "description": "with LLMQ_AUTH_ENABLED: an API "
                                           "key from `llmq keys create`"}},
        },
    }


def _operation(op: Operation, refs: dict[Any, dict[str, Any]]) -> dict[str, Any]:
    body: dict[str, Any] = {"operationId": op.operation_id, "summary": op.summary,
                            "tags": [op.tag]}
    parameters = [_param(p) for p in (*op.params, REQUEST_ID)]
    if op.query is not None:
        query_schema = op.query.model_json_schema()
        required = set(query_schema.get("required", []))
        for name, prop in query_schema["properties"].items():
            prop = dict(prop)
            description = prop.pop("description", "")
            prop.pop("title", None)
            parameters.append({"name": name, "in": "query", "required": name in required,
                               "description": description, "schema": prop})
    if parameters:
        body["parameters"] = parameters
    if op.body is not None:
        body["requestBody"] = {"required": True, "content": {
            op.body_media: {"schema": refs[(op.body, "validation")]}}}
    responses: dict[str, Any] = {}
    # NOTE: a malformed X-Request-Id is a 400 on any operation
    for status, media in sorted({**_errors(400), **op.responses}.items()):
        content = {kind: ({"schema": refs[(model, "validation")]} if model is not None
                          else {"schema": {"type": "string"}})
                   for kind, model in media.items()}
        headers = {REQUEST_ID_HEADER: {"description": "the request's id (the client's, or "
                                       "one the server made)", "schema": {"type": "string"}}}
        if status == 429:
            headers["Retry-After"] = {"description": "seconds to wait",
                                      "schema": {"type": "integer"}}
        responses[str(status)] = {"description": _DESCRIPTIONS.get(status, "answer"),
                                  "content": content, "headers": headers}
    body["responses"] = responses
    return body


def _param(param: Param) -> dict[str, Any]:
    return {"name": param.name, "in": param.where, "required": param.required,
            "description": param.description, "schema": param.schema}


_DESCRIPTIONS = {
    200: "OK", 202: "accepted: the job is queued", 400: "the request is invalid (param "
    "names the field)", 401: "missing or unknown API key", 404: "no such job, model or "
    "route", 409: "the job or batch already ended, or the file is in use",
    413: "body too large", 422: "Idempotency-Key reused with a different request",
    429: "the model's queue is full (LLMQ_MAX_QUEUED_JOBS)",
    500: "the job failed on the server",
    503: "the database or Redis is unreachable, or not ready", 504: "the job did not finish within "
    "LLMQ_REQUEST_TIMEOUT_SECONDS (it was cancelled)",
}


@bp.get("/openapi.json")
def openapi_json() -> Response:
    """The OpenAPI document (built once per app)."""
    document = current_app.extensions.get("llmq_openapi")
    if document is None:
        document = current_app.extensions["llmq_openapi"] = build_openapi()
    return jsonify(document)


_DOCS_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>llmq API</title>
<link rel="stylesheet" href="/docs/assets/swagger-ui.css"></head>
<body><div id="swagger-ui"></div>
<script src="/docs/assets/swagger-ui-bundle.js"></script>
<script>SwaggerUIBundle({url: "/openapi.json", dom_id: "#swagger-ui"});</script>
</body></html>
"""


@bp.get("/docs")
def docs() -> Response:
    """Swagger UI over `/openapi.json`."""
    return Response(_DOCS_PAGE, mimetype="text/html")


@bp.get("/docs/assets/<path:name>")
def docs_asset(name: str) -> Response:
    """Swagger UI's files, from the installed `flask_swagger_ui` package."""
    import flask_swagger_ui

    directory = flask_swagger_ui.__path__[0] + "/dist"
    return send_from_directory(directory, name, max_age=3600)
