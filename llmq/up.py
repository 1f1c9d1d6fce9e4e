"""`llmq up`: the whole stack on one machine, started, announced, supervised, stopped.

`run_up` migrates the database (SQLite in the state directory unless a URL is given),
makes the demo checkpoint on the first run, starts the children through
`llmq.stack.LocalStack`, prints where to send requests once everything answers, and stops
every child in order on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

from llmq.stack import Child, LocalStack, free_port, python_command, wait_until
from llmq.state import StateLock, StateLockedError, database_url_of, state_dir_of

# NOTE: on Ctrl-C the web child gets this long to finish open requests (a non-streaming
# OpenAI call still waits in a request thread); open event streams are closed at once and
# their clients resume from their Last-Event-ID once the API is back.
WEB_GRACEFUL_TIMEOUT_SECONDS = 2.0

logger = logging.getLogger(__name__)


class _Stop(Exception):
    """SIGTERM arrived: stop everything."""


def run_up(args: argparse.Namespace) -> int:
    """`llmq up`: start the stack, print where to send requests, supervise, stop cleanly."""
    state_dir = state_dir_of(args)
    lock = StateLock(state_dir)
    try:
        lock.acquire()
    except StateLockedError as exc:
        _say(f"error: {exc}")
        return 1
    try:
        return _run_locked(args, state_dir)
    finally:
        lock.release()


def _run_locked(args: argparse.Namespace, state_dir: Path) -> int:
    stack = LocalStack(state_dir)

    def on_stop_signal(_signum: int, _frame: object) -> None:
        # NOTE: ignore both at once: a second Ctrl-C or SIGTERM arriving before `finally`
        # runs would otherwise break out of it and leave every child running
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise _Stop()

    previous = signal.signal(signal.SIGTERM, on_stop_signal)
    previous_int = signal.signal(signal.SIGINT, on_stop_signal)
    try:
        if not _port_free(args.host, args.port):
            _say(f"error: {args.host}:{args.port} is in use; pick another with --port")
            return 1
        model_name, model_dir = _model(args, state_dir)
        database_url = database_url_of(args)
        from tasks.db import upgrade_database

        applied = upgrade_database(database_url, quiet=True)
        if applied:
            schema = applied[-1].revision
            count = f"{len(applied)} migration{'' if len(applied) == 1 else 's'}"
            _say(f"database schema created or upgraded: {count} applied, now at {schema}")
        redis_url = args.redis_url or os.environ.get("LLMQ_REDIS_URL")
        if not redis_url:
            port = args.redis_port or free_port()
            redis_url = stack.start_redis(port)
            _say(f"started an embedded Redis on 127.0.0.1:{port} (in memory "
                 "only: it writes nothing to disk)")
        env = _child_env(state_dir, database_url, redis_url, model_name, model_dir)
        group_id = f"local-{socket.gethostname()}"
        worker = stack.spawn("worker", python_command(
            "-m", "workers.main", "--model-name", model_name, "--group-id", group_id,
            "--heartbeat-seconds", "1"), env)
        stack.spawn("beat", python_command("-m", "llmq.cli", "beat"), env)
        stack.spawn("web", python_command(
            "-m", "llmq.cli", "web", "--host", args.host, "--port", str(args.port),
            "--workers", "1", "--threads", str(args.web_threads),
            "--graceful-timeout", f"{WEB_GRACEFUL_TIMEOUT_SECONDS:g}"), env)
        _wait_ready(stack, args, env, model_name, group_id, worker)
        _print_ready(args, env, model_name, state_dir)
        while True:
            stack.restart_dead(_announce_restart)
            time.sleep(0.5)
    except _Stop:
        _say("stopping llmq (draining the worker)...")
        return 0
    except RuntimeError as exc:
        _say(f"error: {exc}")
        return 1
    finally:
        # NOTE: a second Ctrl-C or SIGTERM must not cut the stop short and leave children
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stack.stop()
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
        _say("llmq stopped")


def _announce_restart(child: Child, code: int) -> None:
    _say(f"{child.name} exited with code {code}; starting it again (log: {child.log_path})")


def _model(args: argparse.Namespace, state_dir: Path) -> tuple[str, str]:
    if args.model:
        path = Path(args.model).resolve()
        if not (path / "config.json").exists():
            raise RuntimeError(_not_a_checkpoint(args.model, path))
        return args.model_name or path.name, str(path)
    path = state_dir / "models" / "demo"
    if not (path / "config.json").exists():
        _say(f"creating a {args.demo_preset} demo checkpoint (random weights: it writes "
             f"gibberish) in {path}; this happens on the first run only...")
        started = time.monotonic()
        _make_demo_model(path, args.demo_preset)
        _say(f"demo checkpoint ready in {time.monotonic() - started:.1f}s")
    return args.model_name or "demo", str(path)


def _make_demo_model(path: Path, preset: str) -> None:
    """`llmq make-model` as a child process, its progress lines passed on.

    NOTE: a child, so this process never loads torch: it supervises for hours, and an
    interpreter holding torch and transformers takes seconds to exit after a stop.
    """
    import subprocess

    env = dict(os.environ, LLMQ_LOG_LEVEL="WARNING", TQDM_DISABLE="1")
    repo_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo_root, env.get("PYTHONPATH")) if p)
    command = python_command("-m", "llmq.cli", "make-model", str(path), "--preset", preset,
                             "--seed", "0", "--if-missing")
    with subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True) as child:
        assert child.stdout is not None
        tail: list[str] = []
        for line in child.stdout:
            tail = (tail + [line.rstrip()])[-20:]
            if line.startswith("  "):  # make-model's progress lines
                _say(line.rstrip())
        if child.wait() != 0:
            raise RuntimeError("creating the demo checkpoint failed:\n" + "\n".join(tail))


def _not_a_checkpoint(given: str, path: Path) -> str:
    """What to tell a user whose --model is not a checkpoint directory."""
    message = f"{path} is not a checkpoint directory (no config.json)"
    if not path.exists() and given.count("/") == 1 and not given.startswith((".", "/", "~")):
        # looks like a hub id (Qwen/Qwen3-0.6B): llmq serves local directories only
        local = given.split("/")[1]
        message += (f"; {given!r} looks like a Hugging Face hub id: download it first, e.g. "
                    f"`huggingface-cli download {given} --local-dir {local}`, then pass "
                    f"--model {local}")
    return message


def _child_env(state_dir: Path, database_url: str, redis_url: str, model_name: str,
               model_dir: str) -> dict[str, str]:
    env = dict(os.environ)
    repo_root = str(Path(__file__).resolve().parent.parent)
    env.update({
        "LLMQ_STATE_DIR": str(state_dir),
        "LLMQ_DATABASE_URL": database_url,
        "LLMQ_REDIS_URL": redis_url,
        "LLMQ_MODELS": f"{model_name}={model_dir}",
        # the children import our packages even when llmq is not pip-installed
        "PYTHONPATH": os.pathsep.join(p for p in (repo_root, env.get("PYTHONPATH")) if p),
    })
    return env


def _wait_ready(stack: LocalStack, args: argparse.Namespace, env: dict[str, str],
                model_name: str, group_id: str, worker: Child) -> None:
    import redis

    from tasks.protocol import group_alive_key
    from tasks.settings import Settings

    settings = Settings.from_env(env)
    client = redis.Redis.from_url(settings.redis_url, socket_connect_timeout=2,
                                  socket_timeout=2)
    alive_key = group_alive_key(settings, model_name, group_id)
    last_note = [0.0]

    def progress(elapsed: float) -> None:
        if elapsed - last_note[0] >= 5.0:
            last_note[0] = elapsed
            _say(f"  waiting for the worker to load model {model_name!r}... {elapsed:.0f}s")

    def worker_ready() -> bool:
        try:
            return bool(client.exists(alive_key))
        except redis.RedisError:
            return False

    _say(f"loading model {model_name!r} in the worker (log: {worker.log_path})")
    try:
        wait_until(worker_ready, args.ready_timeout, "the worker", stack.check_alive, progress)
    finally:
        client.close()
    wait_until(lambda: _http_ok(f"http://{_client_host(args.host)}:{args.port}/health"), 60.0,
               "the API", stack.check_alive)


def _print_ready(args: argparse.Namespace, env: dict[str, str], model_name: str,
                 state_dir: Path) -> None:
    from tasks.settings import Settings

    url = f"http://{_client_host(args.host)}:{args.port}"
    body = json.dumps({"model": model_name, "prompt": "Once upon a time", "max_tokens": 32})
    lines = [f"llmq is ready at {url} (model {model_name!r})",
             f"  state and logs: {state_dir}",
             f"  OpenAI API: {url}/v1  jobs API: {url}/v1/jobs  metrics: {url}/metrics",
             f"  dashboard: {url}/  API reference: {url}/docs"]
    auth = ""
    if Settings.from_env(env).auth_enabled:
        lines += ["  API keys are required (LLMQ_AUTH_ENABLED=true); create one with:",
                  f"    export LLMQ_API_KEY=$({_keys_create_command(args, state_dir)} me)"]
        auth = " -H \"Authorization: Bearer $LLMQ_API_KEY\""
    lines += ["  try:",
              f"    curl {url}/v1/completions -H 'Content-Type: application/json'{auth} "
              f"-d '{body}'",
              "  Ctrl-C stops everything."]
    print("\n".join(lines), flush=True)


def _keys_create_command(args: argparse.Namespace, state_dir: Path) -> str:
    """`llmq keys create` pointed at this stack's database, as short as it can be."""
    if args.database_url:
        return "llmq keys create --database-url URL"  # the URL may hold a password
    if os.environ.get("LLMQ_DATABASE_URL") or state_dir == state_dir_of(argparse.Namespace()):
        return "llmq keys create"  # the same environment / directory finds it
    return f"llmq keys create --state-dir {state_dir}"


def _client_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "") else host


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _http_ok(url: str) -> bool:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _say(message: str) -> None:
    """Progress for the person at the terminal (a CLI, so plain stderr lines)."""
    print(message, file=sys.stderr, flush=True)
