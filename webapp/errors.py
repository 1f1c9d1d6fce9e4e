"""One error shape for every failure: OpenAI's `{"error": {type, message, param, code}}`.

Views raise `APIError`; HTTP errors (404, 405, 413, bad JSON), database and Redis outages
and anything unexpected are turned into the same shape here, so no client ever parses an
HTML error page. Outages of Postgres or Redis are 503s that say which one is down.
"""

from __future__ import annotations

import logging

import kombu.exceptions
import redis
import sqlalchemy.exc
from flask import Flask, Response, jsonify
from werkzeug.exceptions import HTTPException

from tasks.job_errors import job_failure

logger = logging.getLogger(__name__)

_TYPE_BY_STATUS = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error answered to the client as JSON with `status`."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.headers = headers or {}
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.type = type or _TYPE_BY_STATUS.get(
            status, "invalid_request_error" if status < 500 else "server_error"
        )

    def response(self) -> Response:
        body = {"error": {"type": self.type, "message": self.message, "param": self.param,
                          "code": self.code}}
        response = jsonify(body)
        response.status_code = self.status
        if self.status == 401:
            response.headers["WWW-Authenticate"] = 'Bearer realm="llmq"'
        response.headers.update(self.headers)
        return response


def database_unavailable() -> APIError:
    return APIError(503, "database_unavailable",
                    "the job database is unreachable; try again shortly (operators: check "
                    "LLMQ_DATABASE_URL and that Postgres is up)")


def redis_unavailable() -> APIError:
    return APIError(503, "redis_unavailable",
                    "Redis (job queue and token streams) is unreachable; try again shortly "
                    "(operators: check LLMQ_REDIS_URL and that Redis is up)")


def failed_job_error(job_id: str, error: str | None, kind: str | None = None) -> APIError:
    """The answer to a request whose job failed (`tasks.job_errors.job_failure`): a 400
    naming the field when the request caused it, else a 500 `job_failed`."""
    failure = job_failure(job_id, error, kind)
    return APIError(failure.status, failure.code, failure.message, failure.param,
                    type=failure.type)


_HTTP_CODES = {400: "bad_request", 404: "not_found", 405: "method_not_allowed",
               413: "request_too_large", 415: "unsupported_media_type",
               422: "unprocessable_entity"}


def register_error_handlers(app: Flask) -> None:
    @app.errorhandler(APIError)
    def _api_error(error: APIError) -> Response:
        return error.response()

    @app.errorhandler(HTTPException)
    def _http_error(error: HTTPException) -> Response:
        status = error.code or 500
        message = error.description or error.name
        valid_methods: list[str] = list(getattr(error, "valid_methods", None) or [])
        if status == 413:
            limit = app.config.get("MAX_CONTENT_LENGTH")
            message = f"the request body is larger than the limit of {limit} bytes"
        elif status == 404:
            message = "no such route; the API lives under /v1 (see /v1/jobs, /v1/models)"
        elif status == 405:
            allowed = ", ".join(sorted(valid_methods))
            message = f"method not allowed on this route; allowed: {allowed or 'none'}"
        response = APIError(status, _HTTP_CODES.get(status, "http_error"), message).response()
        if status == 405 and valid_methods:
            response.headers["Allow"] = ", ".join(valid_methods)
        return response

    @app.errorhandler(sqlalchemy.exc.OperationalError)
    @app.errorhandler(sqlalchemy.exc.InterfaceError)
    @app.errorhandler(sqlalchemy.exc.DisconnectionError)
    @app.errorhandler(sqlalchemy.exc.TimeoutError)  # pool exhausted waiting for a connection
    def _database_down(error: Exception) -> Response:
        logger.warning("database unavailable: %s", error)
        return database_unavailable().response()

    @app.errorhandler(redis.ConnectionError)
    @app.errorhandler(redis.TimeoutError)
    @app.errorhandler(kombu.exceptions.OperationalError)
    def _redis_down(error: Exception) -> Response:
        logger.warning("redis unavailable: %s", error)
        return redis_unavailable().response()

    @app.errorhandler(Exception)
    def _unexpected(error: Exception) -> Response:
        logger.exception("unhandled error")
        return APIError(500, "internal_error",
                        "internal server error; the server log has the details").response()
