"""API keys: created once (the plaintext is shown once), stored as sha256 hashes."""

from __future__ import annotations

import hashlib
import secrets
import uuid

from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from tasks.db import update_count, utcnow
from tasks.models import ApiKey

KEY_PREFIX = "llmq-"


def hash_key(key: str) -> str:
    """sha256 hex of a key; keys are long random strings, so no salt or slow hash is needed."""
    return hashlib.sha256(key.encode()).hexdigest()


def create_api_key(session_factory: sessionmaker[Session], name: str) -> tuple[uuid.UUID, str]:
    """Store a new key named `name`; returns (key id, plaintext key). Only the hash is kept."""
    if not name.strip():
        raise ValueError("an API key needs a non-empty name")
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    row = ApiKey(name=name.strip(), key_hash=hash_key(key), created_at=utcnow())
    with session_factory.begin() as session:
        session.add(row)
    return row.id, key


def find_api_key(session: Session, key: str) -> ApiKey | None:
    """The active (not revoked) key row matching the plaintext `key`."""
    return session.scalar(
        select(ApiKey).where(ApiKey.key_hash == hash_key(key), ApiKey.revoked_at.is_(None))
    )


def revoke_api_key(session_factory: sessionmaker[Session], key_id: uuid.UUID) -> bool:
    """Revoke a key by id; False when there is no such active key."""
    with session_factory.begin() as session:
        return bool(update_count(session, update(ApiKey)
                                 .where(ApiKey.id == key_id, ApiKey.revoked_at.is_(None))
                                 .values(revoked_at=utcnow())))


def list_api_keys(session_factory: sessionmaker[Session]) -> list[ApiKey]:
    with session_factory() as session:
        return list(session.scalars(select(ApiKey).order_by(ApiKey.created_at)))
