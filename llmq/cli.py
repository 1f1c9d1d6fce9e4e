"""The `llmq` command: serve the API, run beat, migrate, manage keys, submit jobs.

Heavy parts load only inside the commands that need them: `worker` and `make-model`
import the engine (torch) lazily, so `llmq --help` and `llmq web` stay light.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
from collections.abc import Callable, Iterator
from typing import Any

from tasks.settings import Settings

logger = logging.getLogger(__name__)

DEFAULT_URL = "http://127.0.0.1:8000"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["worker"]:
        # NOTE: everything after `worker` (--help included) belongs to the worker's parser.
        from workers.main import main as worker_main

        return int(worker_main(argv[1:]) or 0)
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    logging.basicConfig(level=os.environ.get("LLMQ_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        return 130
    except ValueError as exc:  # bad settings or arguments: say what to fix
        print(f"error: {exc}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmq", description="LLM completions as durable asynchronous jobs. Settings come "
        "from LLMQ_* environment variables (LLMQ_DATABASE_URL, LLMQ_REDIS_URL, LLMQ_MODELS...).")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")

    web = sub.add_parser("web", help="serve the HTTP API (gunicorn)",
                         description="Serve the HTTP API with gunicorn's gthread workers: "
                         "each open event stream holds one thread, so size --threads for "
                         "the number of concurrent streams.")
    web.add_argument("--host", default="0.0.0.0")
    web.add_argument("--port", type=int, default=8000)
    web.add_argument("--workers", type=int, default=2, help="gunicorn worker processes")
    web.add_argument("--threads", type=int, default=64, help="threads per worker process")
    web.add_argument("--dev", action="store_true",
                     help="werkzeug's development server instead of gunicorn")
    web.set_defaults(handler=cmd_web)

    beat = sub.add_parser("beat", help="run the periodic maintenance (lease reclaim, stream "
                          "expiry)", description="Run Celery beat with an embedded worker "
                          "for the maintenance tasks. Run exactly one per deployment.")
    beat.add_argument("--loglevel", default="INFO")
    beat.set_defaults(handler=cmd_beat)

    db = sub.add_parser("db", help="database schema", description="Database schema commands.")
    db_sub = db.add_subparsers(title="db commands", metavar="COMMAND")
    upgrade = db_sub.add_parser("upgrade", help="migrate the database to the newest schema",
                                description="Apply every migration (alembic upgrade head) "
                                "to LLMQ_DATABASE_URL.")
    upgrade.set_defaults(handler=cmd_db_upgrade)

    keys = sub.add_parser("keys", help="API keys", description="Manage API keys.")
    keys_sub = keys.add_subparsers(title="keys commands", metavar="COMMAND")
    create = keys_sub.add_parser("create", help="create a key and print it (once)",
                                 description="Create an API key; the key is printed once "
                                 "and only its hash is stored.")
    create.add_argument("name", help="who or what the key is for")
    create.set_defaults(handler=cmd_keys_create)
    listing = keys_sub.add_parser("list", help="list keys (ids and names, never the keys)",
                                  description="List API keys.")
    listing.set_defaults(handler=cmd_keys_list)
    revoke = keys_sub.add_parser("revoke", help="revoke a key by id",
                                 description="Revoke an API key by its id.")
    revoke.add_argument("key_id")
    revoke.set_defaults(handler=cmd_keys_revoke)

    make = sub.add_parser("make-model", help="write a small random checkpoint",
                          description="Write a random checkpoint (tokenizer included) for "
                          "demos and tests.")
    make.add_argument("out_dir")
    make.add_argument("--arch", default="qwen3", help="qwen3, qwen2 or llama")
    make.add_argument("--preset", default="tiny", help="tiny, small or 100m")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--dtype", default="float32")
    make.add_argument("--if-missing", action="store_true",
                      help="do nothing when OUT_DIR already holds a checkpoint (config.json)")
    make.set_defaults(handler=cmd_make_model)

    up = sub.add_parser("up", help="run the whole stack on this machine (embedded Redis, "
                        "SQLite, one CPU worker, beat, the API)",
                        description="Run everything on one machine: SQLite in the state "
                        "directory (unless --database-url / LLMQ_DATABASE_URL), an embedded "
                        "Redis (unless --redis-url / LLMQ_REDIS_URL), one CPU worker, beat "
                        "and the API. Without --model, a small random demo checkpoint is "
                        "created on first run. Ctrl-C stops everything.")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=8000)
    up.add_argument("--state-dir", default=".llmq",
                    help="database, Redis data, demo model and logs (default ./.llmq)")
    up.add_argument("--model", metavar="DIR", help="checkpoint directory to serve")
    up.add_argument("--model-name", help="served name (default: the directory's name, or "
                    "demo)")
    up.add_argument("--demo-preset", default="small", choices=["tiny", "small"],
                    help="size of the demo checkpoint created without --model")
    up.add_argument("--database-url", help="default: sqlite:///<state dir>/llmq.db")
    up.add_argument("--redis-url", help="default: an embedded Redis on --redis-port")
    up.add_argument("--redis-port", type=int, help="port of the embedded Redis (default: free)")
    up.add_argument("--web-threads", type=int, default=32)
    up.add_argument("--ready-timeout", type=float, default=300.0,
                    help="seconds to wait for the worker to load the model")
    up.set_defaults(handler=cmd_up)

    # `llmq worker ...` is handed whole to workers.main.main (see main()); listed for --help
    sub.add_parser("worker", help="run a device-group worker (see `llmq worker --help`)")

    submit = sub.add_parser("submit", help="submit a job and print its tokens as they stream",
                            description="Submit a completion job to a running API and print "
                            "its text as it streams.")
    submit.add_argument("prompt")
    submit.add_argument("--model", help="served model (default: the first of /v1/models)")
    submit.add_argument("--max-tokens", type=int, default=64)
    submit.add_argument("--temperature", type=float, default=None)
    submit.add_argument("--seed", type=int, default=None)
    submit.add_argument("--chat", action="store_true", help="send the prompt as a user message")
    submit.add_argument("--url", default=os.environ.get("LLMQ_URL", DEFAULT_URL))
    submit.add_argument("--api-key", default=os.environ.get("LLMQ_API_KEY"))
    submit.set_defaults(handler=cmd_submit)
    return parser


# --- commands -------------------------------------------------------------------------


def cmd_web(args: argparse.Namespace) -> int:
    settings = Settings.from_env()
    if args.dev:
        from werkzeug.serving import run_simple

        from webapp import create_app

        run_simple(args.host, args.port, create_app(settings), threaded=True)
        return 0
    # NOTE: gthread, not gevent: gevent's monkey patching removes select.epoll, which the
    # tokenizer loading path (huggingface_hub) needs; threads need no patching at all.
    command = [sys.executable, "-m", "gunicorn", "webapp.wsgi:app",
               "--bind", f"{args.host}:{args.port}", "--workers", str(args.workers),
               "--worker-class", "gthread", "--threads", str(args.threads),
               "--timeout", "120", "--graceful-timeout", "30", "--access-logfile", "-"]
    logger.info("serving the API on %s:%d (%d processes x %d threads)", args.host, args.port,
                args.workers, args.threads)
    os.execv(sys.executable, command)  # gunicorn takes over this process and its signals
    return 0  # not reached


def cmd_up(args: argparse.Namespace) -> int:
    from llmq.up import run_up

    return run_up(args)


def cmd_beat(args: argparse.Namespace) -> int:
    from tasks.celery_app import create_celery, maintenance_queue
    from tasks.maintenance import register_maintenance_tasks

    settings = Settings.from_env()
    app = create_celery(settings, beat=True)
    register_maintenance_tasks(app, settings)
    app.worker_main([
        "worker", "--beat", "--pool=threads", "--concurrency=2",
        "-Q", maintenance_queue(settings), "-n", f"llmq-beat@{socket.gethostname()}",
        "--without-gossip", "--without-mingle", "--loglevel", args.loglevel.upper(),
        "--schedule", app.conf.beat_schedule_filename,
    ])
    return 0


def cmd_db_upgrade(_args: argparse.Namespace) -> int:
    from tasks.db import upgrade_database

    upgrade_database(Settings.from_env().database_url)
    print("database is at the newest schema")
    return 0


def _session_factory() -> Any:
    from tasks.db import create_db_engine, make_sessionmaker

    return make_sessionmaker(create_db_engine(Settings.from_env().database_url))


def cmd_keys_create(args: argparse.Namespace) -> int:
    from tasks.auth import create_api_key

    key_id, key = create_api_key(_session_factory(), args.name)
    print(f"created API key {key_id} ({args.name}); it is shown only this once:",
          file=sys.stderr)
    print(key)
    return 0


def cmd_keys_list(_args: argparse.Namespace) -> int:
    from tasks.auth import list_api_keys

    for row in list_api_keys(_session_factory()):
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
    if not revoke_api_key(_session_factory(), key_id):
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
    from workers.engine.make_model import make_model

    path = make_model(args.out_dir, arch=args.arch, preset=args.preset, seed=args.seed,
                      dtype=args.dtype)
    print(path)
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    import requests

    url = args.url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        model = args.model or _first_model(url, headers)
        body: dict[str, Any] = {"model": model, "max_tokens": args.max_tokens}
        if args.chat:
            body["messages"] = [{"role": "user", "content": args.prompt}]
        else:
            body["prompt"] = args.prompt
        for name in ("temperature", "seed"):
            if getattr(args, name) is not None:
                body[name] = getattr(args, name)
        response = requests.post(f"{url}/v1/jobs", json=body, headers=headers, timeout=60)
        if response.status_code >= 400:
            return _print_api_error(response)
        job = response.json()
        print(f"job {job['id']} {job['status']}", file=sys.stderr)
        with requests.get(url + job["links"]["events"], headers=headers, stream=True,
                          timeout=(10, 300)) as stream:
            if stream.status_code >= 400:
                return _print_api_error(stream)
            return _print_events(iter_sse(stream.iter_lines(decode_unicode=True)))
    except requests.ConnectionError:
        print(f"error: cannot reach the API at {url} (start it with `llmq web`, or pass --url)",
              file=sys.stderr)
        return 1


def _first_model(url: str, headers: dict[str, str]) -> str:
    import requests

    response = requests.get(f"{url}/v1/models", headers=headers, timeout=30)
    response.raise_for_status()
    models = [m["id"] for m in response.json()["data"]]
    if not models:
        raise ValueError("the server serves no models (set LLMQ_MODELS on the server)")
    return models[0]


def _print_events(events: Iterator[tuple[str, dict[str, Any]]],
                  write: Callable[[str], Any] = sys.stdout.write) -> int:
    for event_type, data in events:
        if event_type == "token" and data.get("index", 0) == 0:
            write(data.get("text", ""))
            sys.stdout.flush()
        elif event_type == "restart":
            print(f"\n[the job restarts (attempt {data.get('attempt')}); output so far is void]",
                  file=sys.stderr)
        elif event_type == "done":
            write("\n")
            print(f"[{data.get('finish_reason')}; usage {json.dumps(data.get('usage'))}]",
                  file=sys.stderr)
            return 0
        elif event_type in ("error", "cancelled"):
            write("\n")
            print(f"[{event_type}: {data.get('error') or data.get('finish_reason')}]",
                  file=sys.stderr)
            return 1
    print("\n[the event stream ended before the job did]", file=sys.stderr)
    return 1


def iter_sse(lines: Iterator[str | bytes]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(event type, data) pairs of a server-sent event stream; comments are skipped."""
    event_type, data = "message", ""
    for raw in lines:
        line = raw.decode() if isinstance(raw, bytes) else raw
        if not line:
            if data:
                yield event_type, json.loads(data)
            event_type, data = "message", ""
        elif line.startswith("event:"):
            event_type = line[6:].strip()
        elif line.startswith("data:"):
            data += line[5:].strip()


def _print_api_error(response: Any) -> int:
    try:
        error = response.json()["error"]
        message = f"{error['message']} ({error['code']})"
    except (ValueError, KeyError, TypeError):
        message = response.text[:500]
    print(f"error: HTTP {response.status_code}: {message}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
