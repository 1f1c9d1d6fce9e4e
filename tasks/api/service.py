"""Bodies of the service endpoints: `/health`, `/ready`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from tasks.api.errors import ErrorDetail


class Health(BaseModel):
    status: Literal["ok"]
    models: list[str]


class Readiness(BaseModel):
    """200 `ready`, or 503 `unavailable` with each missing part named (and the error)."""

    status: Literal["ready", "unavailable"]
    checks: dict[str, Any]
    missing: list[str] | None = None
    error: ErrorDetail | None = None
