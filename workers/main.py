"""The device-group worker process: one Celery worker (threads pool) around one engine.

    python -m workers.main --model-name NAME [--model-dir DIR] [--group-id ID]
        [--concurrency N] [--dtype D] [--device D] [--block-size B] [--kv-cache-bytes N]
        [--max-num-seqs N] [--max-num-batched-tokens N] [--max-model-len N]
        [--devices 0,1,2,3] [--tp N] [--group-index I]
        [--kv-tier URL ...] [--kv-reuse-filter]

Device groups (docs/device-groups.md): `--devices` split into groups of `--tp`; with
several groups and no `--group-index`, this process supervises one child worker per group
(`workers.groups`); otherwise it runs one group. A group whose TP rank dies hands its
running jobs back to the queue, stops consuming and exits non-zero.

Settings come from `LLMQ_*` (`Settings.from_env()`); flags override them. The group's
engine and threads are `workers.runtime.GroupRuntime`; the Celery task and the bootstep
that starts it before the consumer fetches anything are `workers.bootstep`.

SIGTERM drains: Celery stops consuming, then the runtime stops admitting, lets running
jobs finish within `settings.drain_grace_seconds`, requeues the rest and exits.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

from tasks.celery_app import create_celery
from tasks.settings import Settings
from workers.bootstep import build_app
from workers.engine.topology import (
    TopologyError,
    build_topology,
    check_backend,
    check_model_dir,
    parse_devices,
)
from workers.host_memory import keep_freed_memory
from workers.runtime import DEFAULT_CONCURRENCY, GroupRuntime

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmq worker",
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
    parser.add_argument("--dtype", help="weights and KV dtype: auto (default: bfloat16 on a CPU "
                        "with native bf16, else float32; the checkpoint's on an accelerator), "
                        "float32, bfloat16, float16")
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
                           group=topology.groups[index],
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
    code = main()
    if code:
        # NOTE: a tripped group's batcher may be stuck inside a step (a daemon thread,
        # but interpreter shutdown could still wait on the locks it holds): flush the
        # logs and leave now.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
