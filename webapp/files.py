"""OpenAI's Files API (`/v1/files`): upload a batch input file, list, read, download and
delete files. The bytes live in the database in chunks (`tasks/files.py`), so every web
process and beat read the same file. Files belong to the key that uploaded them (with auth
on, another key's file is a 404). A file past its `expires_at` is a 404 at once, before
beat's sweep deletes it."""

from __future__ import annotations

import json
import logging
import uuid
from datetime import timedelta
from typing import Any, TypeVar

from flask import Blueprint, Response, jsonify, request
from pydantic import BaseModel, ValidationError
from sqlalchemy import or_, select
from werkzeug.datastructures import MultiDict

from tasks.api.errors import SchemaError
from tasks.api.files import ExpiresAfter, FileListQuery
from tasks.db import has_passed, keyset_after, keyset_order, utcnow
from tasks.files import delete_file, iter_file_bytes, store_file
from tasks.models import Batch, BatchStatus, File
from webapp.auth import current_api_key_id
from webapp.errors import APIError
from webapp.jobs import parse_query
from webapp.services import services

logger = logging.getLogger(__name__)

bp = Blueprint("files", __name__, url_prefix="/v1/files")

Owned = TypeVar("Owned", File, Batch)  # rows that belong to the key that made them
MULTIPART_OVERHEAD_BYTES = 64 * 1024  # form fields and boundaries around the file itself
EXPIRES_AFTER = "expires_after"


class _ExpiryField(BaseModel):
    """The upload's `expires_after`, validated under its own name (errors name
    `expires_after.seconds`)."""

    expires_after: ExpiresAfter


@bp.post("")
def create_file() -> Response:
    """Store an uploaded file (`multipart/form-data`: `file`, `purpose=batch`, optional
    `expires_after`)."""
    svc = services()
    api_key_id = current_api_key_id()
    limit = svc.settings.max_file_bytes
    # NOTE: the app's body limit is for JSON requests; a file may be up to its own limit
    request.max_content_length = limit + MULTIPART_OVERHEAD_BYTES
    if not (request.mimetype or "").startswith("multipart/form-data"):
        raise APIError(400, "invalid_request", "upload a file as multipart/form-data with the "
                       "fields file and purpose", "file")
    purpose = request.form.get("purpose")
    if purpose is None:
        raise APIError(400, "invalid_value", "purpose is required (batch)", "purpose")
    if purpose != "batch":
        raise APIError(400, "invalid_value", f"purpose must be 'batch', got {purpose!r}",
                       "purpose")
    expires_after = _expires_after(request.form)
    upload = request.files.get("file")
    if upload is None:
        raise APIError(400, "invalid_value", "file is required: the JSONL file of requests",
                       "file")
    data = upload.read(limit + 1)
    if len(data) > limit:
        raise APIError(413, "file_too_large", f"the file is larger than {limit} bytes, the "
                       "limit (LLMQ_MAX_FILE_BYTES); split it into several batches", "file")
    if not data:
        raise APIError(400, "invalid_value", "file is empty", "file")
    filename = (upload.filename or "upload.jsonl")[:512]
    expires_at = (utcnow() + timedelta(seconds=expires_after.seconds)
                  if expires_after is not None else None)
    with svc.session_factory.begin() as session:
        row = store_file(session, api_key_id=api_key_id, purpose=purpose, filename=filename,
                         data=data, num_lines=data.count(b"\n") + (not data.endswith(b"\n")),
                         expires_at=expires_at)
        body = file_to_dict(row)
    logger.info("file %s stored: %d bytes", body["id"], len(data))
    return jsonify(body)


@bp.get("")
def list_files() -> Response:
    """The caller's files (`?after=`, `?limit=`, `?order=asc|desc`, `?purpose=`)."""
    svc = services()
    api_key_id = current_api_key_id()
    query = parse_query(FileListQuery)
    newest_first = query.order == "desc"
    statement = select(File).order_by(*keyset_order(
        File.created_at, File.id, descending=newest_first)).limit(query.limit + 1)
    if svc.settings.auth_enabled:
        statement = statement.where(File.api_key_id == api_key_id)
    if query.purpose:
        statement = statement.where(File.purpose == query.purpose)
    statement = statement.where(or_(File.expires_at.is_(None), File.expires_at > utcnow()))
    with svc.reads() as session:
        if query.after:
            cursor = visible_file(session, query.after, api_key_id)
            if cursor is None:
                raise APIError(400, "invalid_cursor", "after must be the id of a file from a "
                               "previous page of this listing", "after")
            statement = statement.where(keyset_after(File.created_at, File.id, cursor,
                                                     descending=newest_first))
        rows = list(session.scalars(statement))
    return jsonify(page([file_to_dict(row) for row in rows], query.limit))


@bp.get("/<file_id>")
def get_file(file_id: str) -> Response:
    return jsonify(file_to_dict(load_file(file_id)))


@bp.get("/<file_id>/content")
def get_file_content(file_id: str) -> Response:
    """The file's bytes, streamed chunk by chunk from the database."""
    row = load_file(file_id)
    session_factory = services().session_factory

    def chunks() -> Any:
        with session_factory() as session:
            yield from iter_file_bytes(session, row.id)

    return Response(chunks(), mimetype="application/octet-stream",
                    headers={"Content-Length": str(row.bytes),
                             "Content-Disposition": f'attachment; filename="{row.filename}"'})


@bp.delete("/<file_id>")
def remove_file(file_id: str) -> Response:
    """Delete a file; a 409 while an unfinished batch reads it."""
    row = load_file(file_id)
    with services().session_factory.begin() as session:
        in_use = session.scalar(select(Batch.id).where(
            Batch.input_file_id == row.id,
            Batch.status.in_([s.value for s in BatchStatus if not s.is_terminal])).limit(1))
        if in_use is not None:
            raise APIError(409, "file_in_use", f"batch {in_use} is still running on file "
                           f"{row.id}; cancel it or wait for it to end", "file_id")
        delete_file(session, row.id)
    logger.info("file %s deleted", row.id)
    return jsonify({"id": row.id, "object": "file", "deleted": True})


def _expires_after(form: MultiDict[str, str]) -> ExpiresAfter | None:
    """The upload's expiry policy: OpenAI's clients send the fields
    `expires_after[anchor]` and `expires_after[seconds]`; one `expires_after` field
    holding a JSON object is read too. None when the upload has none."""
    prefix = EXPIRES_AFTER + "["
    # NOTE: werkzeug gives a field whose name is not text the name None
    value: Any = {key[len(prefix):-1]: form[key] for key in form
                  if isinstance(key, str) and key.startswith(prefix) and key.endswith("]")}
    if EXPIRES_AFTER in form:
        try:
            value = json.loads(form[EXPIRES_AFTER])
        except (ValueError, RecursionError):
            raise APIError(400, "invalid_value", "expires_after must be a JSON object "
                           '{"anchor": "created_at", "seconds": N}', EXPIRES_AFTER) from None
        if value is None:  # the schema's null: no expiry
            return None
    elif not value:
        return None
    try:
        return _ExpiryField.model_validate({EXPIRES_AFTER: value}).expires_after
    except ValidationError as exc:
        error = SchemaError.from_validation(exc, _ExpiryField)
        raise APIError(400, "invalid_value", error.message, error.param) from None


def page(data: list[dict[str, Any]], limit: int,
         has_more: bool | None = None) -> dict[str, Any]:
    """OpenAI's cursor page of `data` (read with limit + 1 rows: the extra says has_more;
    or `has_more` given, where the extra row was not made an item)."""
    if has_more is None:
        has_more = len(data) > limit
    data = data[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


def file_to_dict(row: File) -> dict[str, Any]:
    return {"id": row.id, "object": "file", "bytes": row.bytes,
            "created_at": int(row.created_at.timestamp()),
            "expires_at": int(row.expires_at.timestamp()) if row.expires_at else None,
            "filename": row.filename, "purpose": row.purpose, "status": "processed",
            "status_details": None}


def load_file(file_id: str) -> File:
    """The caller's file `file_id`, or a 404 (also for another key's file)."""
    return load_owned(File, file_id, "file")


def visible_file(session: Any, file_id: str, api_key_id: uuid.UUID | None) -> File | None:
    return visible(session, File, file_id, api_key_id)


def load_owned(model: type[Owned], row_id: str, noun: str) -> Owned:
    """The caller's `model` row `row_id` (a file, a batch), or a 404 `<noun>_not_found`
    (also for another key's row)."""
    with services().reads() as session:
        row = visible(session, model, row_id, current_api_key_id())
    if row is None:
        raise APIError(404, f"{noun}_not_found", f"no {noun} {row_id!r}", f"{noun}_id")
    return row


def visible(session: Any, model: type[Owned], row_id: str,
            api_key_id: uuid.UUID | None) -> Owned | None:
    """The row, if the caller may see it: with auth on, only its own key's rows; a file
    only until it expires."""
    row = session.get(model, row_id)
    if row is None or (isinstance(row, File) and has_passed(row.expires_at)):
        return None
    if services().settings.auth_enabled and row.api_key_id != api_key_id:
        return None
    return row
