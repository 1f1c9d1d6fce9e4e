"""Files in the database: a `files` row and its bytes in `file_chunks`, so every web
process and worker reads the same file, and a file lives as long as its row.

Chunks keep each row (and each read) bounded: a 200 MB file is 200 rows of 1 MB, never
one value that a driver must hold twice.

A file may expire (`files.expires_at`): past it the API treats it as gone (a 404), and
beat's sweep deletes it with its chunks (`delete_expired_files`).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from datetime import datetime

from sqlalchemy import delete, select
from sqlalchemy.orm import Session, sessionmaker

from tasks.db import utcnow
from tasks.models import File, FileChunk

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1024 * 1024
EXPIRED_PER_SWEEP = 200  # files deleted per pass; the next pass takes the rest


def new_file_id() -> str:
    return "file-" + uuid.uuid4().hex


def store_file(session: Session, *, api_key_id: uuid.UUID | None, purpose: str,
               filename: str, data: bytes, num_lines: int,
               file_id: str | None = None, expires_at: datetime | None = None) -> File:
    """Add a file and its chunks to `session` (the caller commits)."""
    row = File(id=file_id or new_file_id(), api_key_id=api_key_id, purpose=purpose,
               filename=filename, bytes=len(data), num_lines=num_lines, created_at=utcnow(),
               expires_at=expires_at)
    session.add(row)
    session.flush()  # the row before its chunks (their foreign key)
    for index, start in enumerate(range(0, len(data), CHUNK_BYTES)):
        session.add(FileChunk(file_id=row.id, index=index, data=data[start:start + CHUNK_BYTES]))
    return row


def iter_file_bytes(session: Session, file_id: str) -> Iterator[bytes]:
    """A file's bytes, one chunk at a time, in order."""
    indexes = session.scalars(select(FileChunk.index).where(FileChunk.file_id == file_id)
                              .order_by(FileChunk.index)).all()
    for index in indexes:
        data = session.scalar(select(FileChunk.data).where(FileChunk.file_id == file_id,
                                                           FileChunk.index == index))
        yield bytes(data or b"")


def read_file_bytes(session: Session, file_id: str) -> bytes:
    return b"".join(iter_file_bytes(session, file_id))


def delete_file(session: Session, file_id: str) -> None:
    """Remove a file and its chunks (the caller commits)."""
    session.execute(delete(FileChunk).where(FileChunk.file_id == file_id))
    session.execute(delete(File).where(File.id == file_id))


def delete_expired_files(session_factory: sessionmaker[Session]) -> list[str]:
    """Beat's pass: delete files past their `expires_at`, chunks and all (a file at a
    time, each in its own transaction); returns their ids."""
    with session_factory() as session:
        expired = session.scalars(select(File.id).where(File.expires_at < utcnow())
                                  .order_by(File.expires_at).limit(EXPIRED_PER_SWEEP)).all()
    for file_id in expired:
        with session_factory.begin() as session:
            delete_file(session, file_id)
    if expired:
        logger.info("deleted %d expired files", len(expired))
    return list(expired)
