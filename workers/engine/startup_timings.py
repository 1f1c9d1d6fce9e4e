"""The start-up timings of a model on this machine, kept on disk for the next start.

With `LLMQ_LINEAR_PATH=auto` (the default) a `ModelRunner` on the CPU times its linear
paths, the native kernel's one-row prefetch (row-major weights or fp32 panels), how many
fp32 panels calls of few rows read at once, and whole decode steps with and without the
native decoder before it serves (seconds: 8-13 s of an 11-18 s start for the `100m`
preset in fp32 on two cores). What those timings decide depends on the machine, the
model's shapes, the dtype, the threads and the code that runs, not on anything a start
changes, so the figures are stored under a key of all of those and read back by the next
start with the same key: a restarted worker serves again sooner, and every worker of a
machine runs the plan the first one measured.

`LLMQ_TIMINGS_CACHE` names the directory (default `~/.cache/llmq/timings`); `off` times
at every start. A file is one JSON object, written whole (a temporary file renamed over
it); one that cannot be read or is not this key's is timed again and replaced. Delete the
directory to time again after the machine changed in a way its key cannot see (another
host of the same CPU model with other memory, say).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kernels import cpu
from kernels.native import home_cache_dir

logger = logging.getLogger(__name__)

TIMINGS_CACHE_ENV = "LLMQ_TIMINGS_CACHE"
# bumped when the stored figures change meaning
FORMAT = 4
# the sources whose code is timed or decides what is timed: an edit times again
_PACKAGE_ROOTS = (Path(__file__).resolve().parents[1] / "engine",
                  Path(__file__).resolve().parents[2] / "kernels")
_SOURCE_SUFFIXES = (".py", ".c", ".h")


@dataclass
class StartupTimings:
    """What a start measured: per row count, per linear path, the seconds of a pass over
    the probe weights (`ModelRunner.linear_probe`); per prefetch distance, the seconds of
    a one-row pass (`row_prefetch_probe`); per row count, a decode step's seconds on the
    plan's paths and with the native decoder (`decoder_probe`); per prefetch choice, the
    seconds of a one-row pass on fp32 panels (`panel_prefetch_probe`); per number of
    panels read side by side, the same (`panel_streams_probe`); per number of bf16 weight
    rows read side by side, a one-row pass's (`row_streams_probe`)."""

    linear_probe: dict[int, dict[str, float]] = field(default_factory=dict)
    row_prefetch_probe: dict[int, float] = field(default_factory=dict)
    decoder_probe: dict[int, dict[str, float]] = field(default_factory=dict)
    panel_prefetch_probe: dict[int, float] = field(default_factory=dict)
    panel_streams_probe: dict[int, float] = field(default_factory=dict)
    row_streams_probe: dict[int, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"linear_probe": {str(m): t for m, t in self.linear_probe.items()},
                "row_prefetch_probe": {str(n): t for n, t in self.row_prefetch_probe.items()},
                "decoder_probe": {str(m): t for m, t in self.decoder_probe.items()},
                "panel_prefetch_probe": {str(n): t
                                         for n, t in self.panel_prefetch_probe.items()},
                "panel_streams_probe": {str(n): t
                                        for n, t in self.panel_streams_probe.items()},
                "row_streams_probe": {str(n): t for n, t in self.row_streams_probe.items()}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StartupTimings:
        """Raises ValueError (or KeyError, TypeError) for a record of another shape: every
        figure a positive number of seconds, every linear row count timed on torch's
        `linear` and the same other paths, every decode step on the plan's paths and with
        the decoder."""
        def seconds(t: Any) -> float:
            value = float(t)
            if not 0.0 < value < float("inf"):
                raise ValueError(f"{t!r} is not a time")
            return value

        def by_choice(raw: dict[str, Any]) -> dict[int, float]:
            return {int(n): seconds(t) for n, t in raw.items()}

        def by_path(raw: dict[str, Any], needed: set[str]) -> dict[int, dict[str, float]]:
            out = {int(m): {str(name): seconds(t) for name, t in times.items()}
                   for m, times in raw.items()}
            names = {frozenset(times) for times in out.values()}
            if len(names) > 1 or any(not needed <= name for name in names):
                raise ValueError(f"row counts timed on other paths than "
                                 f"{', '.join(sorted(needed))} and the same others")
            return out
        return cls(linear_probe=by_path(data["linear_probe"], {"reference"}),
                   row_prefetch_probe=by_choice(data["row_prefetch_probe"]),
                   decoder_probe=by_path(data["decoder_probe"], {"plan", "decoder"}),
                   panel_prefetch_probe=by_choice(data["panel_prefetch_probe"]),
                   panel_streams_probe=by_choice(data["panel_streams_probe"]),
                   row_streams_probe=by_choice(data["row_streams_probe"]))


def cache_dir() -> Path | None:
    """Where timings are kept (`LLMQ_TIMINGS_CACHE`), or None when they are not."""
    configured = os.environ.get(TIMINGS_CACHE_ENV, "").strip()
    if configured.lower() == "off":
        return None
    if configured:
        return Path(configured)
    directory = home_cache_dir("timings")
    if directory is None:
        logger.warning("no home directory for the start-up timings: every start times; "
                       "set %s to keep them", TIMINGS_CACHE_ENV)
    return directory


def _code_digest() -> str:
    digest = hashlib.sha256()
    for root in _PACKAGE_ROOTS:
        for path in sorted(p for p in root.rglob("*") if p.suffix in _SOURCE_SUFFIXES):
            digest.update(str(path.relative_to(root.parent)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def timings_key(**parts: object) -> dict[str, str]:
    """The key of a start's timings: the caller's `parts` (the model's config and probe
    shapes, dtype, ranks, rows, settings) with this machine's CPU (model, every flag),
    torch's threads and versions, and the digest of the engine's and kernels' code."""
    key = {name: str(value) for name, value in sorted(parts.items())}
    key["format"] = str(FORMAT)
    key["cpu"] = cpu.cpu_description_key()
    key["torch"] = cpu.describe()  # threads, torch, MKL and oneDNN versions
    key["interop_threads"] = str(torch.get_num_interop_threads())
    key["code"] = _code_digest()
    return key


class TimingsCache:
    """One start's timings on disk: `load` before timing, `store` after."""

    def __init__(self, directory: Path, key: dict[str, str]) -> None:
        self.key = key
        name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
        self.path = directory / f"{name}.json"

    @classmethod
    def configured(cls, **parts: object) -> TimingsCache | None:
        """The cache of a start with these `parts` (`timings_key`), or None when
        `LLMQ_TIMINGS_CACHE=off`."""
        directory = cache_dir()
        return None if directory is None else cls(directory, timings_key(**parts))

    def load(self) -> StartupTimings | None:
        """The stored timings of this key, or None (none yet, unreadable, another key's)."""
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            logger.warning("start-up timings %s unreadable (%s): timing again", self.path, exc)
            return None
        try:
            if data.get("key") != self.key:
                raise ValueError("stored for another key")
            timings = StartupTimings.from_json(data)
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            logger.warning("start-up timings %s not usable (%s): timing again", self.path, exc)
            return None
        return timings

    def store(self, timings: StartupTimings) -> bool:
        """Write `timings` for the next start (whole or not at all); False (logged) when
        the directory cannot be written: the next start times again."""
        record = {"key": self.key, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                  **timings.to_json()}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, partial = tempfile.mkstemp(dir=self.path.parent, suffix=".json.partial")
            try:
                with os.fdopen(fd, "w") as out:
                    json.dump(record, out, indent=1)
                os.replace(partial, self.path)
            except BaseException:
                os.unlink(partial)
                raise
        except OSError as exc:
            logger.warning("start-up timings not kept (%s): the next start times again", exc)
            return False
        return True
