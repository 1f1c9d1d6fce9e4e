"""The device group's heartbeat: who it is and how loaded, in Redis every few seconds.

`<prefix>:groups:<model>` is a hash of group id -> JSON figures (read by `/v1/models`,
`/health` and metrics); `<prefix>:groups:<model>:<group>:alive` is a key whose TTL the
group keeps renewing, so a dead group's figures can be told from a live one's.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from tasks.metrics import WorkerMetrics
from tasks.protocol import group_alive_key, groups_key
from tasks.settings import Settings
from workers.thread_names import name_this_thread

logger = logging.getLogger(__name__)

# how long the last beat of a group that stopped unhealthy stays visible (`/ready` says why)
UNHEALTHY_ALIVE_SECONDS = 60


class BeatPipeline(Protocol):
    """The commands of one beat, sent together (`redis.client.Pipeline`)."""

    def hset(self, name: str, key: str, value: str) -> object: ...

    def set(self, name: str, value: str, ex: int) -> object: ...

    def hdel(self, name: str, *keys: str) -> object: ...

    def delete(self, *names: str) -> object: ...

    def execute(self) -> object: ...


class BeatRedis(Protocol):
    """The Redis client the heartbeat writes with (`redis.Redis`)."""

    def pipeline(self, transaction: bool = True) -> BeatPipeline: ...


# the group's live figures, merged into each beat: JSON values (see GroupRuntime._load)
LoadSource = Callable[[], dict[str, Any]]


@dataclass(slots=True)
class GroupIdentity:
    """What does not change while the group lives."""

    group_id: str
    model: str
    devices: list[str]  # e.g. ["cpu"], ["cuda:0", "cuda:1"]
    capacity: int  # samples admitted at once (max_num_seqs)
    max_model_len: int
    max_num_batched_tokens: int
    block_size: int
    # workers.engine.topology.GroupTopology as a dict: device kind, devices, tp_size, KV capacity
    # in blocks and tokens, rank pids
    topology: dict[str, Any] = field(default_factory=dict)
    hostname: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    started_at: float = field(default_factory=time.time)


class Heartbeat:
    """A daemon thread writing `identity` plus `load()` every `interval` seconds."""

    def __init__(
        self,
        redis: BeatRedis,
        settings: Settings,
        identity: GroupIdentity,
        load: LoadSource,
        *,
        interval: float = 2.0,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.redis = redis
        self.settings = settings
        self.identity = identity
        self.load = load
        self.interval = interval
        self.metrics = metrics  # the batcher's figures, written with each beat
        self.draining = False
        self.unhealthy: str | None = None  # why the group stopped serving (breaker, watchdog)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llmq-heartbeat", daemon=True)

    def start(self) -> None:
        try:
            self.beat()  # visible before the first task is fetched
        except Exception:  # Redis blinked: the thread beats again shortly
            logger.warning("first heartbeat of %s failed", self.identity.group_id,
                           exc_info=True)
        self._thread.start()

    def stop(self, *, remove: bool = True) -> None:
        """End the thread and remove this group's entry (`remove=False`: a failed group
        leaves its last, unhealthy beat until the alive key expires, so `/ready` says why)."""
        self._stop.set()
        self._thread.join(self.interval + 5.0)
        if not remove:
            try:
                self.beat(alive_seconds=UNHEALTHY_ALIVE_SECONDS)
            except Exception:
                logger.warning("could not write the last heartbeat of %s",
                               self.identity.group_id, exc_info=True)
            return
        try:
            pipe = self.redis.pipeline(transaction=False)
            if self.metrics is not None:  # the figures of the last jobs (drain)
                self.metrics.write(pipe, self.settings, self.identity.model)
            pipe.hdel(groups_key(self.settings, self.identity.model), self.identity.group_id)
            pipe.delete(self._alive_key())
            pipe.execute()
        except Exception:  # the alive key expires on its own
            logger.warning("could not remove the heartbeat of %s", self.identity.group_id,
                           exc_info=True)

    def figures(self) -> dict[str, Any]:
        figures = asdict(self.identity)
        figures.update(self.load())
        figures["draining"] = self.draining
        figures["healthy"] = self.unhealthy is None
        if self.unhealthy is not None:
            figures["unhealthy_reason"] = self.unhealthy
        figures["updated_at"] = time.time()
        return figures

    def beat(self, alive_seconds: int | None = None) -> None:
        figures = self.figures()
        payload = json.dumps(figures, separators=(",", ":"))
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(groups_key(self.settings, self.identity.model), self.identity.group_id,
                  payload)
        pipe.set(self._alive_key(), payload,
                 ex=alive_seconds or max(1, int(self.interval * 3 + 0.999)))
        metrics, written = self.metrics, None
        if metrics is not None:
            # NOTE: the service counters ride on this pipeline: no extra round trip
            metrics.observe_engine(figures)
            written = metrics.write(pipe, self.settings, self.identity.model)
        try:
            pipe.execute()
        except Exception:
            if metrics is not None and written is not None:
                metrics.restore(written)
            raise

    def _alive_key(self) -> str:
        return group_alive_key(self.settings, self.identity.model, self.identity.group_id)

    def _run(self) -> None:
        name_this_thread()
        failing_since: float | None = None  # a Redis outage is logged once, not every beat
        while not self._stop.wait(self.interval):
            try:
                self.beat()
            except Exception as exc:  # retried next interval
                if failing_since is None:
                    failing_since = time.monotonic()
                    logger.warning("heartbeat of %s failed (%s: %s); retrying every %.1f s "
                                   "quietly until it succeeds", self.identity.group_id,
                                   type(exc).__name__, exc, self.interval)
                continue
            if failing_since is not None:
                logger.warning("heartbeat of %s is back after %.1f s", self.identity.group_id,
                               time.monotonic() - failing_since)
                failing_since = None
