"""Service endpoints: `/health` (liveness), `/health/ready`, `/v1/models`."""

from __future__ import annotations

import json
import logging
from typing import Any

from flask import Blueprint, Response, jsonify
from sqlalchemy import text

from tasks.model_registry import ModelLoadError
from tasks.protocol import group_alive_key, groups_key
from webapp.services import services

logger = logging.getLogger(__name__)

bp = Blueprint("meta", __name__)


@bp.get("/health")
def health() -> Response:
    """The process is alive (touches no other service)."""
    return jsonify({"status": "ok", "models": services().models.names()})


@bp.get("/health/ready")
def ready() -> Response:
    """Ready when Postgres and Redis answer; a 503 naming what is down otherwise."""
    svc = services()
    with svc.session_factory() as session:
        session.execute(text("SELECT 1"))
    svc.redis.ping()
    return jsonify({"status": "ready"})


@bp.get("/v1/models")
def list_models() -> Response:
    """Served models with their context length and live device groups (from heartbeats)."""
    svc = services()
    names = svc.models.names()
    pipe = svc.redis.pipeline(transaction=False)
    for name in names:
        pipe.hgetall(groups_key(svc.settings, name))
    heartbeats: list[dict[bytes, bytes]] = pipe.execute()
    pipe = svc.redis.pipeline(transaction=False)
    candidates = [(name, group_id.decode()) for name, groups in zip(names, heartbeats)
                  for group_id in groups]
    for name, group_id in candidates:
        pipe.exists(group_alive_key(svc.settings, name, group_id))
    alive = {candidate for candidate, exists in zip(candidates, pipe.execute()) if exists}
    data = []
    for name, groups in zip(names, heartbeats):
        try:
            max_model_len: int | None = svc.models.max_model_len(name)
        except ModelLoadError as exc:
            logger.error("model %s: %s", name, exc)
            max_model_len = None
        live = [_group(group_id.decode(), raw) for group_id, raw in sorted(groups.items())
                if (name, group_id.decode()) in alive]
        data.append({"id": name, "object": "model", "owned_by": "llmq",
                     "max_model_len": max_model_len, "groups": live, "num_live_groups": len(live)})
    return jsonify({"object": "list", "data": data})


def _group(group_id: str, raw: bytes) -> dict[str, Any]:
    try:
        info = json.loads(raw)
    except ValueError:
        info = {}
    if not isinstance(info, dict):
        info = {}
    return {"id": group_id, **info}
