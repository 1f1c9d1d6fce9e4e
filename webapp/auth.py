"""Who is calling: the API key of the request, when auth is on.

With `LLMQ_AUTH_ENABLED=false` (the local default) every caller is anonymous and jobs carry
no key. With auth on, a key sees only its own jobs: another key's job is a 404, exactly
as if it did not exist.
"""

from __future__ import annotations

import uuid

from flask import g, request

from tasks.auth import find_api_key
from webapp.errors import APIError
from webapp.services import services


def current_api_key_id() -> uuid.UUID | None:
    """The calling key's id (None when auth is off); raises a 401 APIError otherwise."""
    if "api_key_id" in g:
        return g.api_key_id
    svc = services()
    key_id: uuid.UUID | None = None
    if svc.settings.auth_enabled:
        header = request.headers.get("Authorization", "")
        scheme, _, key = header.partition(" ")
        if not header:
            raise APIError(401, "missing_api_key",
                           "missing API key: send 'Authorization: Bearer <key>' (create one "
                           "with `llmq keys create NAME`)")
        if scheme.lower() != "bearer" or not key.strip():
            raise APIError(401, "invalid_api_key",
                           "malformed Authorization header: expected 'Bearer <key>'")
        with svc.reads() as session:
            row = find_api_key(session, key.strip())
            if row is None:
                raise APIError(401, "invalid_api_key", "invalid or revoked API key")
            key_id = row.id
    g.api_key_id = key_id
    return key_id


def require_key_for_metadata() -> None:
    """/v1/models and /metrics: a key is needed when auth is on, unless the deployment
    opened them (`LLMQ_METADATA_REQUIRES_KEY=false`); raises a 401 APIError."""
    settings = services().settings
    if settings.auth_enabled and settings.metadata_requires_key:
        current_api_key_id()
