"""The device-group worker process: one Celery worker (threads pool) around one engine.

    python -m workers.main --model-name NAME [--model-dir DIR] [--group-id ID]
        [--concurrency N] [--dtype D] [--device D] [--block-size B] [--kv-cache-bytes N]
        [--max-num-seqs N] [--max-num-batched-tokens N] [--max-model-len N]
        [--devices 0,1,2,3] [--tp N] [--group-index I]

Device groups (docs/device-groups.md): `--devices` split into groups of `--tp`; with
several groups and no `--group-index`, this process supervises one child worker per group
(`workers.groups`); otherwise it runs one group. A group whose TP rank dies
fails its running jobs, stops consuming and exits non-zero.
        [--kv-tier URL ...] [--kv-reuse-filter]

Settings come from `LLMQ_*` (`Settings.from_env()`); flags override them. A worker
bootstep loads the engine ONCE, before the consumer fetches anything, and starts the
batcher, writer, heartbeat and cancel-listener threads. Celery task threads run only the
short `generate` body (claim, wait for room, hand over).

SIGTERM drains: Celery stops consuming, then our step stops admitting, lets running jobs
finish within `settings.drain_grace_seconds`, requeues the rest (row back to queued, a
`restart` event, a new generate message) and exits.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import asdict
from typing import Any

from celery import Celery, bootsteps

from tasks.celery_app import create_celery, send_generate
from tasks.protocol import GENERATE_TASK
from tasks.settings import Settings
from workers.engine.topology import (
    DeviceGroup,
    GroupTopology,
    TopologyError,
    build_topology,
    check_backend,
    check_model_dir,
    parse_devices,
)
from workers.host_memory import keep_freed_memory

logger = logging.getLogger(__name__)

CLAIM_RETRY_SECONDS = 2.0  # a claim that failed on Postgres is retried this much later
DEFAULT_CONCURRENCY = 4  # task threads: enough to keep admission ahead of the engine


class GroupRuntime:
    """Everything a device group runs besides Celery's consumer; built by the bootstep."""

    def __init__(self, settings: Settings, app: Celery, model_name: str, model_dir: str,
                 group_id: str, *, heartbeat_seconds: float = 2.0,
                 concurrency: int = DEFAULT_CONCURRENCY, group: DeviceGroup | None = None,
                 tp_timeout_seconds: float = 120.0) -> None:
        self.group = group
        self.tp_timeout_seconds = tp_timeout_seconds
        self.failure: str | None = None  # why the group's runner failed (it then exits)
        self.settings = settings
        self.app = app
        self.model_name = model_name
        self.model_dir = model_dir
        self.group_id = group_id
        self.heartbeat_seconds = heartbeat_seconds
        self.concurrency = concurrency
        self.admission: Any = None
        self._started = False
        self._stopped = threading.Event()

    def start(self) -> None:
        # NOTE: heavy imports here, not at module import: `--help` stays instant.
        from tasks.db import create_db_engine, make_sessionmaker
        from tasks.redis_client import make_redis
        from tasks.streams.publish import EventPublisher
        from workers.admission import JobAdmission
        from workers.batcher import Batcher
        from workers.cancel_listener import CancelListener
        from workers.db_writer import DbWriter
        from workers.engine.builder import build_engine
        from workers.engine.config import EngineConfig
        from workers.heartbeat import GroupIdentity, Heartbeat

        s = self.settings
        config = EngineConfig(
            block_size=s.block_size, max_num_seqs=s.max_num_seqs,
            max_num_batched_tokens=s.max_num_batched_tokens, max_model_len=s.max_model_len,
            enable_prefix_caching=s.enable_prefix_caching,
        )
        started = time.monotonic()
        group = self.group or build_topology(s.device, None, 1).groups[0]
        tp = group.tp_size
        self.engine = build_engine(
            self.model_dir, dtype=s.dtype,
            device=group.kind.value if tp > 1 else group.device_name(0),
            kv_cache_bytes=s.kv_cache_bytes, config=config, kv_tiers=s.kv_tiers,
            kv_key_prefix=s.redis_prefix, kv_reuse_filter=s.kv_reuse_filter,
            tensor_parallel_size=tp, device_indices=group.devices if tp > 1 else None,
            tp_timeout_seconds=self.tp_timeout_seconds,
        )
        logger.info("group %s loaded %s from %s in %.1fs (max_model_len %d)", self.group_id,
                    self.model_name, self.model_dir, time.monotonic() - started,
                    self.engine.max_model_len)
        self.redis = make_redis(s.redis_url)
        # one connection per task thread (claims) plus the writer's, and a little slack
        self.db_engine = create_db_engine(s.database_url, pool_size=self.concurrency + 2,
                                          max_overflow=2)
        session_factory = make_sessionmaker(self.db_engine)
        publisher = EventPublisher(self.redis, s)
        self.writer = DbWriter(s, session_factory, publisher.publish, self.send_generate,
                               self.group_id)
        self.batcher = Batcher(self.engine, publisher, self.writer,
                               capacity=s.max_num_seqs)
        self.admission = JobAdmission(s, session_factory, self.redis, self.batcher,
                                      self.writer, self.group_id, self.send_generate)
        self.cancels = CancelListener(self.redis, s, self.batcher.cancel)
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
        self.writer.start()
        self.batcher.start()
        self.cancels.start()
        self.heartbeat.start()
        self._started = True
        if hasattr(runner, "on_failure"):
            runner.on_failure(self._on_runner_failure)
        logger.info("group %s serving queue %s", self.group_id, s.queue_for(self.model_name))

    def _on_runner_failure(self, reason: str) -> None:
        """A TP rank is lost: admit nothing more, let the batcher fail the running jobs
        (its step raises), then stop the worker so the queue goes to healthy groups."""
        self.failure = reason
        logger.error("group %s cannot run another step (%s); stopping", self.group_id, reason)
        self.batcher.stop_admitting()  # waiting and new messages go back to the queue

        def stop_worker() -> None:
            deadline = time.monotonic() + self.tp_timeout_seconds + 10.0
            while self.batcher.load().num_jobs and time.monotonic() < deadline:
                time.sleep(0.1)
            os.kill(os.getpid(), signal.SIGTERM)  # Celery's warm shutdown runs our drain

        threading.Thread(target=stop_worker, name="llmq-group-failed", daemon=True).start()

    def send_generate(self, job_id: str) -> None:
        send_generate(self.app, self.settings, job_id, self.model_name)

    def generate(self, job_id: str) -> str:
        if self.admission is None:  # the consumer starts after our step; defensive only
            raise RuntimeError("the device group is not started yet")
        return self.admission.run(job_id).value

    def _load(self) -> dict[str, Any]:
        load = self.batcher.load()
        engine = load.engine
        tiering = self.engine.kv_tiering
        return {
            # cumulative per-tier counters: {tier: {figure: value}} (tasks.metrics)
            "kv_tiers": tiering.figures() if tiering is not None else {},
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
        }

    def stop(self) -> None:
        """Drain: stop admitting, finish or requeue every job, flush, remove the heartbeat."""
        if not self._started or self._stopped.is_set():
            return
        self._stopped.set()
        grace = self.settings.drain_grace_seconds
        logger.info("group %s draining (grace %.1fs, %d jobs)", self.group_id, grace,
                    self.batcher.load().num_jobs)
        self.heartbeat.draining = True
        self.admission.close()
        aborted = self.batcher.drain(grace)
        self.admission.wait_idle(timeout=10.0)
        for job in aborted:
            self.writer.requeue(job.job_id, job.attempt + 1)
        if aborted:
            logger.info("group %s requeued %d unfinished jobs", self.group_id, len(aborted))
        self.writer.stop()
        self.engine.close()  # KV blocks still queued for the tiers
        self.cancels.stop()
        self.heartbeat.stop()
        self.redis.close()
        self.db_engine.dispose()
        logger.info("group %s stopped", self.group_id)

    terminate = stop


def make_group_step(runtime: GroupRuntime) -> type[bootsteps.StartStopStep]:
    """A worker bootstep owning `runtime`: started after the pool, stopped before it."""

    class DeviceGroupStep(bootsteps.StartStopStep):
        # NOTE: after the Pool so it stops BEFORE the pool joins its task threads (a task
        # blocked in admission is released by our stop); the Consumer starts last and
        # stops first, so no message is fetched once the drain begins.
        requires = ("celery.worker.components:Pool",)
        label = "llmq device group"

        def create(self, worker: Any) -> GroupRuntime:
            return runtime

    return DeviceGroupStep


def build_app(settings: Settings, runtime: GroupRuntime) -> Celery:
    app = runtime.app

    from workers.admission import AdmissionRetry

    @app.task(name=GENERATE_TASK, bind=True, ignore_result=True, max_retries=None)
    def generate(task: Any, job_id: str) -> str:
        try:
            return runtime.generate(job_id)
        except AdmissionRetry as exc:
            raise task.retry(countdown=CLAIM_RETRY_SECONDS, exc=exc) from None

    app.steps["worker"].add(make_group_step(runtime))
    return app


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m workers.main",
                                     description="Run one llmq device-group worker.")
    parser.add_argument("--model-name", required=True, help="served model name (its queue)")
    parser.add_argument("--model-dir", help="checkpoint directory (default: LLMQ_MODELS entry)")
    parser.add_argument("--group-id", help="device group id (default: <host>-<pid>)")
    parser.add_argument("--concurrency", type=int, default=DEFAULT_CONCURRENCY,
                        help="Celery task threads (admission only)")
    parser.add_argument("--device", help="device kind: cpu, cuda or npu (cuda:1 = one "
                                         "device; default LLMQ_DEVICE)")
    parser.add_argument("--devices", help="this host's device indices to serve, e.g. 0,1,2,3 "
                                          "or 0-3 (logical ranks on CPU); split into groups "
                                          "of --tp")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel size: devices per group (default 1)")
    parser.add_argument("--group-index", type=int,
                        help="run only this group of the topology (one group per process, "
                             "e.g. one compose service per group)")
    parser.add_argument("--tp-timeout", type=float, default=120.0,
                        help="seconds a TP collective or rank may stall before the group "
                             "is declared failed")
    parser.add_argument("--dtype")
    parser.add_argument("--block-size", type=int)
    parser.add_argument("--kv-cache-bytes", type=int)
    parser.add_argument("--max-num-seqs", type=int)
    parser.add_argument("--max-num-batched-tokens", type=int)
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--kv-tier", dest="kv_tiers", action="append", metavar="URL",
                        help="a KV cache tier below the device, fastest first; repeatable: "
                             "redis://host:port/db, file:///dir?max_bytes=N "
                             "(default: LLMQ_KV_TIERS; docs/kv-tiers.md)")
    parser.add_argument("--kv-reuse-filter", action=argparse.BooleanOptionalAction,
                        help="store a KV block to the tiers only once two sequences ended "
                             "holding it (default: LLMQ_KV_REUSE_FILTER)")
    parser.add_argument("--heartbeat-seconds", type=float, default=2.0)
    parser.add_argument("--switch-interval", type=float, default=0.0005,
                        help="Python GIL switch interval, seconds (latency of token delivery)")
    parser.add_argument("--loglevel", default=os.environ.get("LLMQ_LOG_LEVEL", "INFO"))
    return parser


ENGINE_FLAGS = ("device", "dtype", "block_size", "kv_cache_bytes", "max_num_seqs",
                "max_num_batched_tokens", "max_model_len")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.loglevel.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides = {k: getattr(args, k) for k in ENGINE_FLAGS if getattr(args, k) is not None}
    if args.kv_tiers:
        overrides["kv_tiers"] = tuple(args.kv_tiers)
    if args.kv_reuse_filter is not None:
        overrides["kv_reuse_filter"] = args.kv_reuse_filter
    try:
        settings = Settings.from_env(**overrides)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    model_dir = args.model_dir or settings.models.get(args.model_name)
    if not model_dir:
        print(f"error: no checkpoint for model {args.model_name!r}: pass --model-dir or set "
              f"LLMQ_MODELS={args.model_name}=/path/to/checkpoint", file=sys.stderr)
        return 2
    if args.concurrency < 1:
        print("error: --concurrency must be >= 1", file=sys.stderr)
        return 2
    try:
        topology = build_topology(settings.device,
                                  parse_devices(args.devices) if args.devices else None,
                                  args.tp)
        check_backend(topology)
        check_model_dir(model_dir, args.tp)
    except TopologyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.group_index is None and len(topology.groups) > 1:
        from workers.groups import run_groups

        return run_groups(list(sys.argv[1:] if argv is None else argv), len(topology.groups),
                          args.group_id)
    index = args.group_index or 0
    if not 0 <= index < len(topology.groups):
        print(f"error: --group-index {index}: the topology has {len(topology.groups)} "
              f"group(s) (0..{len(topology.groups) - 1})", file=sys.stderr)
        return 2
    # NOTE: the batcher thread holds the GIL through most of a step; a thread waiting for
    # it (the step publisher: tokens out of the door) would wait up to the 5 ms default
    # switch interval. 0.5 ms bounds that wait at a negligible cost to the step.
    sys.setswitchinterval(args.switch_interval)
    keep_freed_memory()
    group_id = args.group_id or f"{socket.gethostname()}-{os.getpid()}"
    app = create_celery(settings)
    runtime = GroupRuntime(settings, app, args.model_name, model_dir, group_id,
                           heartbeat_seconds=args.heartbeat_seconds,
                           concurrency=args.concurrency, group=topology.groups[index],
                           tp_timeout_seconds=args.tp_timeout)
    build_app(settings, runtime)
    try:
        app.worker_main([
            "worker", "--pool=threads", "--concurrency", str(args.concurrency),
            "-Q", settings.queue_for(args.model_name), "--prefetch-multiplier=1",
            "-n", f"{group_id}@{socket.gethostname()}", "--without-gossip",
            "--without-mingle", "--without-heartbeat", "--loglevel", args.loglevel.upper(),
        ])
    except SystemExit as exc:
        if runtime.failure is None and exc.code not in (None, 0):
            raise
    if runtime.failure is not None:
        logger.error("group %s exits after a failure: %s", group_id, runtime.failure)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
