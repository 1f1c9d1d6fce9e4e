"""The server-side commands of `llmq`: web, up, beat, db upgrade, keys, make-model, config.

Each imports what it needs when it runs: `llmq --help` loads none of them.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from typing import Any

from llmq.state import database_url_of, settings_of, state_dir_of, upgrade_command

logger = logging.getLogger(__name__)


class CommandError(RuntimeError):
    """A state the user can fix; `llmq` prints the message as one line and exits 1."""


def _export_state(args: argparse.Namespace) -> None:
    """Put the command's state flags in the environment of the process (and of the
    processes it starts, e.g. gunicorn's workers), where `Settings.from_env` reads them."""
    os.environ["LLMQ_STATE_DIR"] = str(state_dir_of(args))
    os.environ["LLMQ_DATABASE_URL"] = database_url_of(args)


def cmd_web(args: argparse.Namespace) -> int:
    _export_state(args)
    settings = settings_of(args)
    _require_schema(args)  # not a 503 per request on an unmigrated database
    if args.dev:
        from werkzeug.serving import run_simple

        from webapp import create_app

        run_simple(args.host, args.port, create_app(settings), threaded=True)
        return 0
    command = web_command(args.host, args.port, args.workers, args.threads,
                          args.graceful_timeout)
    logger.info("serving the API on %s:%d (%d processes x %d threads)", args.host, args.port,
                args.workers, args.threads)
    os.execv(sys.executable, command)  # gunicorn takes over this process and its signals
    return 0  # not reached


def web_command(host: str, port: int, workers: int, threads: int,
                graceful_timeout: float) -> list[str]:
    """The gunicorn command line `llmq web` runs (also started this way by tests)."""
    # NOTE: gthread threads serve requests; each process's stream server holds the open
    # event streams (webapp/stream_worker.py), so an idle stream costs no thread. Not
    # gevent: its monkey patching removes select.epoll, which the tokenizer loading path
    # (huggingface_hub) needs.
    return [sys.executable, "-m", "gunicorn", "webapp.wsgi:app",
            "--bind", f"{host}:{port}", "--workers", str(workers),
            "--worker-class", "webapp.stream_worker.StreamWorker", "--threads", str(threads),
            "--timeout", "120", "--graceful-timeout", f"{graceful_timeout:g}",
            "--access-logfile", "-"]


def cmd_up(args: argparse.Namespace) -> int:
    from llmq.up import run_up

    return run_up(args)


def cmd_beat(args: argparse.Namespace) -> int:
    from tasks.celery_app import create_celery, maintenance_queue
    from tasks.maintenance import register_maintenance_tasks

    _export_state(args)
    settings = settings_of(args)
    _require_schema(args)
    app = create_celery(settings, beat=True)
    register_maintenance_tasks(app, settings)
    app.worker_main([
        "worker", "--beat", "--pool=threads", "--concurrency=2",
        "-Q", maintenance_queue(settings), "-n", f"llmq-beat@{socket.gethostname()}",
        "--without-gossip", "--without-mingle", "--loglevel", args.loglevel.upper(),
        "--schedule", app.conf.beat_schedule_filename,
    ])
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    """Print the effective settings, one `LLMQ_NAME=value` per line (passwords masked)."""
    settings = settings_of(args)
    for variable, value in settings.effective().items():
        if isinstance(value, bool):
            value = "true" if value else "false"
        print(f"{variable}={'' if value is None else value}")
    return 0


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    import sqlalchemy

    from tasks.db import current_revision, upgrade_database

    url = database_url_of(args)
    try:
        applied = upgrade_database(url, quiet=True)  # said below, in its own words
        revision = current_revision(url)
    except sqlalchemy.exc.DBAPIError as exc:
        reason = str(exc.orig).strip().splitlines()[0] if exc.orig else type(exc).__name__
        raise CommandError(f"cannot migrate the database: {reason}") from None
    for step in applied:
        print(f"applied {step}")
    print(f"database is at the newest schema ({revision})")
    return 0


def _require_schema(args: argparse.Namespace) -> str:
    """The command's database URL, once it is known to answer at the newest schema (a
    one-line CommandError naming `llmq db upgrade` otherwise)."""
    from tasks.db import DatabaseNotReady, check_schema

    url = database_url_of(args)
    try:
        check_schema(url, upgrade_command(args))
    except DatabaseNotReady as exc:
        raise CommandError(str(exc)) from None
    return url


def _session_factory(args: argparse.Namespace) -> Any:
    """Sessions on the command's database, once it is known to be migrated."""
    from tasks.db import create_db_engine, make_sessionmaker

    return make_sessionmaker(create_db_engine(_require_schema(args)))


def cmd_keys_create(args: argparse.Namespace) -> int:
    from tasks.auth import create_api_key

    key_id, key = create_api_key(_session_factory(args), args.name)
    print(f"created API key {key_id} ({args.name}); it is shown only this once:",
          file=sys.stderr)
    print(key)
    return 0


def cmd_keys_list(args: argparse.Namespace) -> int:
    from tasks.auth import list_api_keys

    for row in list_api_keys(_session_factory(args)):
        state = f"revoked {row.revoked_at:%Y-%m-%d %H:%M}" if row.revoked_at else "active"
        print(f"{row.id}  {row.created_at:%Y-%m-%d %H:%M}  {state:<24} {row.name}")
    return 0


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    import uuid

    from tasks.auth import revoke_api_key

    try:
        key_id = uuid.UUID(args.key_id)
    except ValueError:
        raise ValueError(f"{args.key_id!r} is not a key id (see `llmq keys list`)") from None
    if not revoke_api_key(_session_factory(args), key_id):
        print(f"error: no active key {key_id}", file=sys.stderr)
        return 1
    print(f"revoked {key_id}")
    return 0


def cmd_make_model(args: argparse.Namespace) -> int:
    from pathlib import Path

    if args.if_missing and (Path(args.out_dir) / "config.json").exists():
        print(f"{args.out_dir} already holds a checkpoint; left as is", file=sys.stderr)
        print(args.out_dir)
        return 0
    import time

    from workers.engine.make_model import make_model

    started = time.monotonic()

    def progress(step: str) -> None:
        print(f"  {step}... ({time.monotonic() - started:.1f}s)", file=sys.stderr, flush=True)

    try:
        path = make_model(args.out_dir, arch=args.arch, preset=args.preset, seed=args.seed,
                          dtype=args.dtype, overwrite=args.force, progress=progress)
    except FileExistsError as exc:
        raise CommandError(f"{exc}; pass --force to replace it, or --if-missing to keep "
                           "it") from None
    print(path)
    return 0
