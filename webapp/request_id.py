"""`X-Request-Id`: every answer carries one, the client's or one the server made.

A client's id (1 to 200 printable ASCII characters) is echoed as it came; without one the
server makes `req_<32 hex>`; a malformed one is a 400 (which carries a server-made id).
The create endpoints store it on the job (`jobs.request_id`), so a client's log line and
the job can be matched.
"""

from __future__ import annotations

import uuid

from flask import Flask, Response, g, request

from webapp.errors import APIError

HEADER = "X-Request-Id"
MAX_REQUEST_ID_CHARS = 200


def current_request_id() -> str:
    """This request's id (set before any view runs)."""
    return str(g.request_id)


def init_app(app: Flask) -> None:
    app.before_request(_read_request_id)
    app.after_request(_echo_request_id)


def _read_request_id() -> None:
    value = request.headers.get(HEADER)
    g.request_id = f"req_{uuid.uuid4().hex}"
    if value is None:
        return
    if not 0 < len(value) <= MAX_REQUEST_ID_CHARS or not _printable_ascii(value):
        raise APIError(400, "invalid_request_id", f"{HEADER} must be 1 to "
                       f"{MAX_REQUEST_ID_CHARS} printable ASCII characters", HEADER)
    g.request_id = value


def _printable_ascii(value: str) -> bool:
    return all(" " <= char <= "~" for char in value)


def _echo_request_id(response: Response) -> Response:
    # NOTE: g.request_id is missing only when a before_request handler registered
    # earlier (none today) failed first
    request_id = g.get("request_id")
    if request_id is not None:
        response.headers[HEADER] = request_id
    return response
