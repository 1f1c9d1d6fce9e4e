"""The `llmq` command line: the parser and the dispatch to each command's handler
(`llmq.commands` for the server side, `llmq.submit` for the client).

Heavy parts load only inside the commands that need them: `worker` and `make-model`
import the engine (torch) lazily, so `llmq --help` and `llmq web` stay light.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from llmq.batch import add_batch_parser
from llmq.bench.args import add_cli_args as add_bench_args
from llmq.bench.main import cmd_bench
from llmq.commands import (
    CommandError,
    cmd_beat,
    cmd_config,
    cmd_db_upgrade,
    cmd_keys_create,
    cmd_keys_list,
    cmd_keys_revoke,
    cmd_make_model,
    cmd_up,
    cmd_web,
)
from llmq.state import add_state_flags
from llmq.submit import DEFAULT_URL, cmd_submit


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["worker"]:
        # NOTE: everything after `worker` (--help included) belongs to the worker's parser.
        from workers.main import main as worker_main

        return int(worker_main(argv[1:]) or 0)
    # NOTE: the benchmark is a client only: it builds its own parser, so it imports
    # nothing of the server (the full parser reads make-model's choices from the engine).
    parser = build_bench_parser() if argv[:1] == ["bench"] else build_parser()
    args = parser.parse_args(argv[1:] if argv[:1] == ["bench"] else argv)
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
    except CommandError as exc:  # a state the user can fix (no database, a lock held...)
        print(f"error: {exc}", file=sys.stderr)
        return 1


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, except defaults that say nothing (None, False)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        if "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llmq")
    except PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmq", formatter_class=HelpFormatter,
        description="LLM completions as durable asynchronous jobs. Settings come "
        "from LLMQ_* environment variables (LLMQ_DATABASE_URL, LLMQ_REDIS_URL, LLMQ_MODELS...).")
    parser.add_argument("--version", action="version", version=f"llmq {_version()}")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")

    def command(parent: Any, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        return parent.add_parser(name, formatter_class=HelpFormatter, **kwargs)

    web = command(sub, "web", help="serve the HTTP API (gunicorn)",
                  description="Serve the HTTP API with gunicorn's gthread workers: "
                  "threads serve requests; open event streams are held by each "
                  "process's stream server and hold no thread.")
    web.add_argument("--host", default="127.0.0.1",
                     help="address to listen on (0.0.0.0: every interface; turn on "
                     "LLMQ_AUTH_ENABLED before you expose the API)")
    web.add_argument("--port", type=int, default=8000, help="TCP port")
    web.add_argument("--workers", type=int, default=2, help="gunicorn worker processes")
    web.add_argument("--threads", type=int, default=64, help="threads per worker process")
    web.add_argument("--graceful-timeout", type=float, default=30.0,
                     help="seconds open requests get to finish on SIGTERM (event "
                     "streams are cut; clients resume them with Last-Event-ID)")
    web.add_argument("--dev", action="store_true",
                     help="werkzeug's development server instead of gunicorn")
    add_state_flags(web)
    web.set_defaults(handler=cmd_web)

    beat = command(sub, "beat", help="run the periodic maintenance (lease reclaim, stream "
                   "expiry)", description="Run Celery beat with an embedded worker "
                   "for the maintenance tasks. Run exactly one per deployment.")
    beat.add_argument("--loglevel", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    add_state_flags(beat)
    beat.set_defaults(handler=cmd_beat)

    config = command(sub, "config", help="print the effective settings (secrets masked)",
                     description="Print every setting as LLMQ_NAME=value, read from the "
                     "environment and the state flags as every command reads them; "
                     "passwords in URLs are masked. A bad value is an error naming its "
                     "variable.")
    add_state_flags(config)
    config.set_defaults(handler=cmd_config)

    db = command(sub, "db", help="database schema", description="Database schema commands.")
    db_sub = db.add_subparsers(title="db commands", metavar="COMMAND")
    upgrade = command(db_sub, "upgrade", help="migrate the database to the newest schema",
                      description="Apply every migration (alembic upgrade head) to the "
                      "database (the same one `llmq up` uses when run in this directory).")
    add_state_flags(upgrade)
    upgrade.set_defaults(handler=cmd_db_upgrade)

    keys = command(sub, "keys", help="API keys", description="Manage API keys (in the "
                   "same database `llmq up` uses when run in this directory).")
    keys_sub = keys.add_subparsers(title="keys commands", metavar="COMMAND")
    create = command(keys_sub, "create", help="create a key and print it (once)",
                     description="Create an API key; the key is printed once "
                     "and only its hash is stored.")
    create.add_argument("name", help="who or what the key is for")
    add_state_flags(create)
    create.set_defaults(handler=cmd_keys_create)
    listing = command(keys_sub, "list", help="list keys (ids and names, never the keys)",
                      description="List API keys.")
    add_state_flags(listing)
    listing.set_defaults(handler=cmd_keys_list)
    revoke = command(keys_sub, "revoke", help="revoke a key by id",
                     description="Revoke an API key by its id.")
    revoke.add_argument("key_id", help="the key's id (see `llmq keys list`)")
    add_state_flags(revoke)
    revoke.set_defaults(handler=cmd_keys_revoke)

    from workers.engine.make_model import ARCHITECTURES, PRESETS  # plain data, no torch

    make = command(sub, "make-model", help="write a small random checkpoint",
                   description="Write a random checkpoint (tokenizer included) for "
                   "demos and tests. It is written beside OUT_DIR and renamed into place, "
                   "so a failed run leaves nothing behind.")
    make.add_argument("out_dir", help="directory to create")
    make.add_argument("--arch", default="qwen3", choices=sorted(ARCHITECTURES),
                      help="model architecture")
    make.add_argument("--preset", default="tiny", choices=list(PRESETS), help="model size")
    make.add_argument("--seed", type=int, default=0, help="random seed of the weights")
    make.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                      help="weights dtype")
    existing = make.add_mutually_exclusive_group()
    existing.add_argument("--if-missing", action="store_true",
                          help="do nothing when OUT_DIR already holds a checkpoint")
    existing.add_argument("--force", action="store_true",
                          help="replace what OUT_DIR holds")
    make.set_defaults(handler=cmd_make_model)

    up = command(sub, "up", help="run the whole stack on this machine (embedded Redis, "
                 "SQLite, one CPU worker, beat, the API)",
                 description="Run everything on one machine: SQLite in the state "
                 "directory (unless --database-url / LLMQ_DATABASE_URL), an embedded "
                 "Redis (unless --redis-url / LLMQ_REDIS_URL), one CPU worker, beat "
                 "and the API. Without --model, a small random demo checkpoint is "
                 "created on first run. Ctrl-C stops everything.")
    up.add_argument("--host", default="127.0.0.1", help="address the API listens on")
    up.add_argument("--port", type=int, default=8000, help="TCP port of the API")
    add_state_flags(up)
    up.add_argument("--model", metavar="DIR", help="checkpoint directory to serve (download "
                    "a hub model first: huggingface-cli download ID --local-dir DIR)")
    up.add_argument("--model-name", help="served name (default: the directory's name, or "
                    "demo)")
    up.add_argument("--demo-preset", default="small", choices=["tiny", "small"],
                    help="size of the demo checkpoint created without --model")
    up.add_argument("--redis-url", help="default: an embedded Redis on --redis-port")
    up.add_argument("--redis-port", type=int, help="port of the embedded Redis (default: free)")
    up.add_argument("--web-threads", type=int, default=32, help="threads of the API process")
    up.add_argument("--ready-timeout", type=float, default=300.0,
                    help="seconds to wait for the worker to load the model")
    up.set_defaults(handler=cmd_up)

    # `llmq worker ...` is handed whole to workers.main.main (see main()); listed for --help
    sub.add_parser("worker", help="run a device-group worker (see `llmq worker --help`)")

    submit = command(sub, "submit", help="submit a job and print its tokens as they stream",
                     description="Submit a completion job to a running API and print "
                     "its text as it streams.")
    submit.add_argument("prompt", help="the prompt text")
    submit.add_argument("--model", help="served model (default: the first of /v1/models)")
    submit.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    submit.add_argument("--temperature", type=float, default=None,
                        help="sampling temperature (default: the server's, 1.0)")
    submit.add_argument("--seed", type=int, default=None, help="sampling seed")
    submit.add_argument("--chat", action="store_true", help="send the prompt as a user message")
    submit.add_argument("--url", default=os.environ.get("LLMQ_URL", DEFAULT_URL),
                        help="the API's base URL ($LLMQ_URL)")
    submit.add_argument("--api-key", default=os.environ.get("LLMQ_API_KEY"),
                        help="API key when the server requires one (default: $LLMQ_API_KEY)")
    submit.set_defaults(handler=cmd_submit)
    add_batch_parser(sub, command, os.environ.get("LLMQ_URL", DEFAULT_URL),
                     os.environ.get("LLMQ_API_KEY"))

    # listed for `llmq --help`; `llmq bench ...` is parsed by build_bench_parser()
    sub.add_parser("bench", help="benchmark a serving endpoint (vLLM's `bench serve` flags, "
                   "table and JSON; see `llmq bench --help`)", add_help=False)
    return parser


def build_bench_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmq bench", formatter_class=HelpFormatter,
        description="Benchmark an OpenAI-compatible server or llmq's jobs API with `vllm "
        "bench serve`'s flags, metrics, printed table and result JSON.")
    add_bench_args(parser)
    parser.set_defaults(handler=cmd_bench)
    return parser


if __name__ == "__main__":
    sys.exit(main())
