"""Service endpoints: `/health` (liveness), `/ready` (readiness; `/health/ready` is an
alias), `/v1/models`."""

from __future__ import annotations

import logging
import os
from typing import Any

import redis
import sqlalchemy.exc
from flask import Blueprint, Response, jsonify
from sqlalchemy import text

from webapp.auth import require_key_for_metadata
from webapp.errors import APIError
from webapp.groups import live_groups as _live_groups
from webapp.model_registry import ModelLoadError
from webapp.services import services

logger = logging.getLogger(__name__)

bp = Blueprint("meta", __name__)


@bp.get("/health")
def health() -> Response:
    """The process is alive (touches no other service)."""
    return jsonify({"status": "ok", "models": services().models.names()})


@bp.get("/ready")
@bp.get("/health/ready")
def ready() -> tuple[Response, int]:
    """Ready when the database and Redis answer and every served model has a live device
    group; otherwise a 503 whose `missing` names each part that is not there."""
    svc = services()
    missing: list[str] = []
    checks: dict[str, Any] = {}
    try:
        with svc.reads() as session:
            session.execute(text("SELECT 1"))
        checks["database"] = "ok"
    except sqlalchemy.exc.SQLAlchemyError as exc:
        logger.warning("readiness: database unreachable: %s", exc)
        checks["database"] = "unreachable"
        missing.append("database (check LLMQ_DATABASE_URL)")
    live: dict[str, list[dict[str, Any]]] = {}
    try:
        svc.redis.ping()
        checks["redis"] = "ok"
        live = _live_groups(svc.models.names())
    except redis.RedisError as exc:
        logger.warning("readiness: redis unreachable: %s", exc)
        checks["redis"] = "unreachable"
        missing.append("redis (check LLMQ_REDIS_URL)")
    if checks["redis"] == "ok":
        # NOTE: a group whose breaker tripped leaves an unhealthy last beat: not a worker
        unhealthy = {name: {group["id"]: group.get("unhealthy_reason", "unhealthy")
                            for group in groups if group.get("healthy") is False}
                     for name, groups in live.items()}
        live = {name: [group for group in groups if group["id"] not in unhealthy[name]]
                for name, groups in live.items()}
        if any(unhealthy.values()):
            checks["unhealthy"] = {name: ids for name, ids in unhealthy.items() if ids}
        checks["workers"] = {name: len(groups) for name, groups in live.items()}
        # each live group's devices and KV capacity (workers.engine.topology.GroupTopology)
        checks["topology"] = {name: [{"id": group["id"], **group.get("topology", {})}
                                     for group in groups] for name, groups in live.items()}
        for name, groups in live.items():
            if not groups:
                missing.append(f"a live worker for model {name!r} (start `llmq worker "
                               f"--model-name {name}`)")
    if missing:
        error = APIError(503, "not_ready", "not ready; missing: " + "; ".join(missing))
        return jsonify({"error": {"type": error.type, "message": error.message, "param": None,
                                  "code": error.code},
                        "status": "unavailable", "missing": missing, "checks": checks}), 503
    return jsonify({"status": "ready", "checks": checks}), 200


@bp.get("/v1/models")
def list_models() -> Response:
    """Served models (OpenAI's list shape) with their checkpoint, context length and live
    device groups (from heartbeats: load, limits and `topology` — device kind, devices,
    tp_size, KV capacity in blocks and tokens)."""
    require_key_for_metadata()
    svc = services()
    names = svc.models.names()
    live = _live_groups(names)
    data = []
    for name in names:
        try:
            max_model_len: int | None = svc.models.max_model_len(name)
        except ModelLoadError as exc:
            logger.error("model %s: %s", name, exc)
            max_model_len = None
        root = svc.settings.models[name]
        data.append({"id": name, "object": "model", "created": _created(root),
                     "owned_by": "llmq", "root": root, "parent": None,
                     "max_model_len": max_model_len, "groups": live[name],
                     "num_live_groups": len(live[name])})
    return jsonify({"object": "list", "data": data})


def _created(path: str) -> int:
    """The checkpoint's modification time (unix seconds), 0 when unreadable."""
    try:
        return int(os.stat(os.path.join(path, "config.json")).st_mtime)
    except OSError:
        return 0
