"""A device group's runtime: the engine and every thread around it, started and drained
as one.

`GroupRuntime.start()` loads the engine ONCE (the worker bootstep calls it before the
consumer fetches anything), starts the group's database process (its writer and claims,
workers/db_process.py) and the batcher, step publisher, batch feeder, heartbeat and
cancel-listener threads; `generate(job_id)` is the body of the Celery task (admission:
claim, wait for room, hand over). `stop()` drains: stop admitting, let running jobs finish
within `settings.drain_grace_seconds`, requeue the rest (row back to queued, a `restart`
event, a new generate message), flush the writes and end the database process, remove
the heartbeat.

The circuit breaker (DESIGN.md section 1): `settings.max_consecutive_step_failures`
failed steps in a row (the batcher counts them), a device error (a step raising
`DeviceGroupError`, or the runner's failure callback: a lost tensor-parallel rank), or a
step running past `settings.step_timeout_seconds` (the watchdog thread here), TRIP the
group: it stops
claiming, hands every job back to the queue without spending its attempt, publishes
nothing more for them, says `healthy: false` in its heartbeat, and exits non-zero. A
hung batcher thread is a daemon and is never joined, so it cannot keep the process alive.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from celery import Celery

from tasks.api.batches import is_batch_priority
from tasks.celery_app import send_generate
from tasks.settings import Settings
from workers.engine.topology import DeviceGroup, DeviceKind, GroupTopology, build_topology
from workers.host_memory import freeze_startup_objects

if TYPE_CHECKING:
    from workers.admission import JobAdmission

logger = logging.getLogger(__name__)

DEFAULT_CONCURRENCY = 4  # task threads: enough to keep admission ahead of the engine


class GroupRuntime:
    """Everything a device group runs besides Celery's consumer; built by the bootstep."""

    def __init__(self, settings: Settings, app: Celery, model_name: str, model_dir: str,
                 group_id: str, *, heartbeat_seconds: float = 2.0,
                 group: DeviceGroup | None = None, tp_timeout_seconds: float = 120.0) -> None:
        self.group = group
        self.tp_timeout_seconds = tp_timeout_seconds
        self.failure: str | None = None  # why the group's runner failed (it then exits)
        self.settings = settings
        self.app = app
        self.model_name = model_name
        self.model_dir = model_dir
        self.group_id = group_id
        self.heartbeat_seconds = heartbeat_seconds
        self.admission: JobAdmission | None = None
        self._started = False
        self._stopped = threading.Event()
        self._trip_lock = threading.Lock()
        self.tripped = False  # the breaker or the watchdog stopped the group

    def start(self) -> None:
        # NOTE: heavy imports here, not at module import: `--help` stays instant.
        from tasks.api.batches import BATCH_PRIORITY
        from tasks.redis_client import make_redis
        from tasks.streams.publish import EventPublisher
        from workers.admission import JobAdmission
        from workers.batch_feeder import BatchFeeder
        from workers.batcher import Batcher
        from workers.cancel_listener import CancelListener
        from workers.db_process import DbProcess
        from workers.engine.builder import build_engine
        from workers.engine.config import EngineConfig
        from workers.heartbeat import GroupIdentity, Heartbeat
        from workers.thread_priority import batcher_nice

        s = self.settings
        config = EngineConfig(
            block_size=s.block_size, max_num_seqs=s.max_num_seqs,
            max_num_batched_tokens=s.max_num_batched_tokens, max_model_len=s.max_model_len,
            enable_prefix_caching=s.enable_prefix_caching,
            background_priority=BATCH_PRIORITY,
        )
        started = time.monotonic()
        # the database process (writes, claims) imports and connects while the model loads
        self.db = DbProcess(s, self.group_id, self.model_name,
                            healthy=self._steps_complete, on_lost=self._on_lost,
                            on_exit=self._on_db_process_exit)
        self.db.launch()
        group = self.group or build_topology(s.device, None, 1).groups[0]
        tp = group.tp_size
        try:
            self.engine = build_engine(
                self.model_dir, dtype=s.dtype,
                device=group.kind.value if tp > 1 else group.device_name(0),
                kv_cache_bytes=s.kv_cache_bytes, config=config, kv_tiers=s.kv_tiers,
                kv_key_prefix=s.redis_prefix, kv_reuse_filter=s.kv_reuse_filter,
                tensor_parallel_size=tp, device_indices=group.devices if tp > 1 else None,
                tp_timeout_seconds=self.tp_timeout_seconds,
            )
        except Exception as exc:
            # NOTE: Celery logs the traceback and stops; workers.main turns this into a
            # one-line error and exit code 1 (a supervisor must not take it for a clean stop)
            self.failure = f"could not load model {self.model_name!r} from {self.model_dir}: {exc}"
            self.db.stop(5.0)
            raise
        logger.info("group %s loaded %s from %s in %.1fs (max_model_len %d)", self.group_id,
                    self.model_name, self.model_dir, time.monotonic() - started,
                    self.engine.max_model_len)
        self.redis = make_redis(s.redis_url)
        self._wait_for_redis()
        publisher = EventPublisher(self.redis, s)
        # NOTE: a CPU tensor-parallel group's ranks (processes of their own) share the
        # host's cores: the engine's threads are all of theirs
        ranks_on_cpu = tp if group.kind is DeviceKind.CPU else 1
        nice, why = batcher_nice(s.batcher_nice, _engine_threads() * ranks_on_cpu,
                                 _usable_cores())
        logger.info("the batcher's nice value: %d (%s)", nice, why)
        self.batcher = Batcher(self.engine, publisher, self.db,
                               capacity=s.max_num_seqs,
                               max_consecutive_failed_steps=s.max_consecutive_step_failures,
                               on_unhealthy=self._on_breaker,
                               fault_inject_step_failures=s.fault_inject_step_failures,
                               stream_interval=s.stream_interval_seconds, nice=nice)
        self.admission = JobAdmission(s, self.db.claims, self.batcher, self.db,
                                      self.group_id, self.send_generate,
                                      model=self.model_name)
        self.batch_feeder = BatchFeeder(self.admission, self.batcher, self.model_name)
        self.cancels = CancelListener(self.redis, s, self.batcher.cancel,
                                      model=self.model_name,
                                      on_batch_lines=self.batch_feeder.wake)
        runner = self.engine.runner
        topology = GroupTopology(
            device_kind=group.kind.value, devices=group.device_names, tp_size=tp,
            num_kv_blocks=self.engine.num_blocks,
            num_kv_tokens=self.engine.num_blocks * self.engine.block_size,
            rank_pids=list(getattr(runner, "rank_pids", [os.getpid()])),
        )
        identity = GroupIdentity(
            group_id=self.group_id, model=self.model_name, devices=group.device_names,
            capacity=s.max_num_seqs, max_model_len=self.engine.max_model_len,
            max_num_batched_tokens=s.max_num_batched_tokens, block_size=s.block_size,
            topology=asdict(topology),
        )
        self.heartbeat = Heartbeat(self.redis, s, identity, self._load,
                                   interval=self.heartbeat_seconds, metrics=self.batcher.metrics)
        freeze_startup_objects()  # after loading, before serving
        self.db.start()
        self.batcher.start()
        self.cancels.start()
        self.batch_feeder.start()
        self.heartbeat.start()
        threading.Thread(target=self._watch_steps, name="llmq-step-watchdog",
                         daemon=True).start()
        self._started = True
        if hasattr(runner, "on_failure"):
            runner.on_failure(self._on_runner_failure)
        logger.info("group %s serving queue %s", self.group_id, s.queue_for(self.model_name))

    def _on_runner_failure(self, reason: str) -> None:
        """A TP rank is lost (the runner's watcher thread): trip the group. The batcher
        ends after the step in flight (it raises `DeviceGroupError`), or at once when idle,
        and `_on_breaker` hands its jobs back."""
        logger.error("group %s cannot run another step (%s); stopping", self.group_id, reason)
        self.batcher.trip(f"device error: {reason}")

    def _wait_for_redis(self) -> None:
        """A worker started before Redis waits for it (broker, streams, heartbeat)."""
        backoff, logged = 0.2, False
        while True:
            try:
                self.redis.ping()
                if logged:
                    logger.info("group %s: Redis at %s answers", self.group_id,
                                _redacted(self.settings.redis_url))
                return
            except Exception as exc:
                if not logged:
                    logger.warning("group %s is waiting for Redis at %s (broker, token "
                                   "streams, heartbeat): %s", self.group_id,
                                   _redacted(self.settings.redis_url), exc)
                    logged = True
                time.sleep(backoff)
                backoff = min(5.0, backoff * 2)

    # -- health ----------------------------------------------------------------------------

    def _steps_complete(self) -> bool:
        """The writer renews leases only while this holds: a step (or an idle wait) ended
        within the last half lease (true before the batcher exists: nothing is owned)."""
        batcher = getattr(self, "batcher", None)
        if batcher is None:
            return True
        return batcher.health.seconds_since_progress() < self.settings.lease_seconds / 2

    def _on_db_process_exit(self, reason: str) -> None:
        """The database process died: nothing the group computes can be stored any more.
        Stop as a hung group does (publish nothing more; the leases run out and other
        groups rerun the jobs). Before serving, `start()` raises instead."""
        if self._started:
            self._trip(reason, hung=True)

    def _on_lost(self, job_id: str, attempt: int) -> None:
        self.batcher.lose(job_id, attempt)

    def _watch_steps(self) -> None:
        """The watchdog: trip the group when one step runs past the step timeout."""
        timeout = self.settings.step_timeout_seconds
        while not self._stopped.wait(min(1.0, timeout / 4)):
            started = self.batcher.health.step_started_at
            if started is not None and time.monotonic() - started > timeout:
                self._trip(f"a step ran longer than {timeout:g}s "
                           "(LLMQ_STEP_TIMEOUT_SECONDS)", hung=True)
                return

    def _on_breaker(self, reason: str) -> None:
        """The batcher stopped after consecutive failed steps (its thread)."""
        self._trip(reason, hung=False)

    def _trip(self, reason: str, *, hung: bool) -> None:
        """Stop claiming, hand every job back (attempt not spent), say unhealthy, exit."""
        with self._trip_lock:
            if self.failure is not None:
                return
            self.failure = reason
            self.tripped = True
        logger.error("group %s is unhealthy (%s): handing its jobs back and exiting",
                     self.group_id, reason)
        self.heartbeat.unhealthy = reason
        self.batcher.stop_admitting()
        if self.admission is not None:
            self.admission.close()
        self.batch_feeder.stop()
        if hung:
            # NOTE: the batcher is stuck inside a step: nothing it publishes or writes
            # later may reach the jobs' streams (the publisher is closed) or rows (they
            # are queued, or another group's, so its fenced writes match nothing).
            self.batcher.publisher.close()
            jobs = self.db.owned()
            batch_lines: set[str] = set()  # not known here: every job gets a message
        else:
            jobs = {job.job_id: job.attempt for job in self.batcher.aborted}
            batch_lines = {job.job_id for job in self.batcher.aborted
                           if is_batch_priority(job.priority)}
            self.batcher.aborted = []
        for job_id, attempt in jobs.items():
            self.db.requeue(job_id, attempt, give_back=True,
                            send_message=job_id not in batch_lines)
        logger.error("group %s handed back %d jobs", self.group_id, len(jobs))
        try:
            self.heartbeat.beat()
        except Exception:
            logger.warning("could not report %s unhealthy", self.group_id, exc_info=True)
        # Celery's warm shutdown runs our stop(); from a thread: the caller may be the
        # batcher, which must end its loop first
        threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGTERM),
                         name="llmq-group-tripped", daemon=True).start()

    def send_generate(self, job_id: str) -> None:
        send_generate(self.app, self.settings, job_id, self.model_name)

    def generate(self, job_id: str) -> str:
        if self.admission is None:  # the consumer starts after our step; defensive only
            raise RuntimeError("the device group is not started yet")
        return self.admission.run(job_id).value

    def _load(self) -> dict[str, Any]:
        load = self.batcher.load()
        engine = load.engine
        connector = self.engine.kv_connector
        return {
            # cumulative per-tier counters: {tier: {figure: value}} (tasks.metrics)
            "kv_tiers": connector.figures() if connector is not None else {},
            "num_jobs": load.num_jobs,
            "active_samples": load.num_active_samples,
            "num_running": engine.get("num_running", 0),
            "num_waiting": engine.get("num_waiting", 0),
            "kv_cache_usage": engine.get("kv_cache_usage", 0.0),
            "num_preemptions": engine.get("num_preemptions", 0),
            "prefix_cache_queries": engine.get("prefix_cache_queries", 0),
            "prefix_cache_hits": engine.get("prefix_cache_hits", 0),
            "prompt_tokens_total": engine.get("prompt_tokens_total", 0),
            "generation_tokens_total": engine.get("generation_tokens_total", 0),
            "num_steps": engine.get("num_steps", load.num_steps),
            "num_interrupted_steps": engine.get("num_interrupted_steps", 0),
            # unix time the engine figures above were read (the batcher reads them every
            # half second; the heartbeat goes out every few seconds)
            "engine_stats_at": load.updated_at,
        }

    def stop(self) -> None:
        """Drain: stop admitting, finish or requeue every job, flush, remove the heartbeat."""
        if not self._started or self.admission is None or self._stopped.is_set():
            return
        self._stopped.set()
        grace = self.settings.drain_grace_seconds
        logger.info("group %s draining (grace %.1fs, %d jobs)", self.group_id, grace,
                    self.batcher.load().num_jobs)
        self.heartbeat.draining = True
        self.admission.close()
        self.batch_feeder.stop()
        aborted = []
        if self.tripped:
            # the jobs were handed back already; a hung batcher is not waited for
            self.batcher.join(0.5)
        else:
            aborted = self.batcher.drain(grace)
        self.admission.wait_idle(timeout=10.0)
        for job in aborted:
            # NOTE: not the job's fault: the attempt is given back (rolling restarts never
            # spend a job's retry budget)
            self.db.requeue(job.job_id, job.attempt, give_back=True,
                            send_message=not is_batch_priority(job.priority))
        if aborted:
            logger.info("group %s requeued %d unfinished jobs", self.group_id, len(aborted))
        self.db.stop()
        if self.tripped and self.batcher.is_alive():
            logger.error("group %s: the batcher is stuck in a step; not waiting for it",
                         self.group_id)
        else:
            self.engine.close()  # KV blocks still queued for the tiers
        self.cancels.stop()
        self.heartbeat.stop(remove=not self.tripped)
        self.redis.close()
        logger.info("group %s stopped", self.group_id)

    terminate = stop



def _redacted(url: str) -> str:
    """`url` without a password, for the log."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return url
    return f"{scheme}://***@{rest.rpartition('@')[2]}"


def _engine_threads() -> int:
    """The engine's intra-op threads (torch's, shared with the native kernels)."""
    import torch

    return int(torch.get_num_threads())


def _usable_cores() -> int:
    """The cores this process may run on."""
    getaffinity = getattr(os, "sched_getaffinity", None)
    return len(getaffinity(0)) if getaffinity is not None else (os.cpu_count() or 1)
