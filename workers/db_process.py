"""The group's database work in a process of its own, so its Python never holds the
batcher's GIL.

Every native call of a step gives the GIL up and must win it back; a thread of the same
process that runs Python meanwhile delays every one of them. A synthetic thread running
Python 13% of a core cost the offline engine 13% of its rate; the same load in another
process cost it nothing (docs/benchmarks.md). The group's Postgres work is most of that
Python: the writer (`DbWriter`: a transaction per batch of results, lease renewals,
terminal events; ~0.25 ms of CPU per batch line) and the claims (`JobClaims`: the
conditional UPDATEs, their rows, the cancel flags; ~0.2 ms per batch line, and an
interactive job's claim waited for the GIL between each of its round trips).

`DbProcess` is the handle the worker holds: `DbWriter`'s calls (`progress`, `finish`,
`requeue`, `flush`, `owned`, `stop`; no `own`: the claims own what they claim) and, as
`claims`, `JobClaims`'s (`one`, `with_ahead`, `lines`), each a message on a socket pair
to `python -m workers.db_process`, which runs an unchanged `DbWriter` and `JobClaims`
(its own database pool, Redis client, and Celery app for requeue messages). A claim
blocks its caller (a task thread, the batch feeder) until the rows come back, already
owned; claims run on threads of their own there, beside the writer. Writes keep the order
they were sent in, so a terminal row is still written after the job's progress, and its
terminal event still follows its last token event (the batcher hands a result over only
once its token events are out).

Back to the worker: `lost` (a write found the row moved on: `on_lost`) and replies. The
worker tells the database process every `HEALTH_SECONDS` whether steps complete; leases
are renewed only while the last word was yes and is recent.

Either side ending ends the link: the database process reads EOF when the worker is gone
(killed too), writes what it holds and exits; the worker reads EOF when the database
process died and calls `on_exit` (the runtime then stops the group: nothing it computes
could be stored, and lease expiry gives its jobs to other groups). The database process
ignores SIGINT and SIGTERM: a Ctrl-C on the terminal reaches the whole process group, and
the worker's drain still needs it.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

from tasks.settings import Settings
from workers.claims import ClaimedRow, ClaimUnavailable
from workers.job_rows import JobProgress, JobResult
from workers.thread_names import name_this_thread

logger = logging.getLogger(__name__)

HEALTH_SECONDS = 0.5  # how often the worker says whether steps complete
CLAIM_THREADS = 2  # claims run at once in the database process
READY_TIMEOUT_SECONDS = 60.0  # start-up: imports, a database pool, Redis, Celery
REPLY_TIMEOUT_SECONDS = 10.0  # `owned()`


class DbProcess:
    """The worker's end: `DbWriter`'s and `JobClaims`'s calls, run by the database
    process."""

    def __init__(self, settings: Settings, group_id: str, model: str, *,
                 healthy: Callable[[], bool] | None = None,
                 on_lost: Callable[[str, int], None] | None = None,
                 on_exit: Callable[[str], None] | None = None) -> None:
        self.settings = settings
        self.group_id = group_id
        self.model = model
        self.healthy = healthy  # None: always healthy
        self.on_lost = on_lost
        self.on_exit = on_exit  # the database process died (not stopped by us)
        self.claims = RemoteClaims(self)
        self._conn: Connection | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._send_lock = threading.Lock()
        self._tokens = itertools.count(1)
        self._replies: dict[int, list[Any]] = {}  # token -> [threading.Event, reply]
        self._replies_lock = threading.Lock()
        self._ready = threading.Event()
        self._stopping = False
        self._closed = threading.Event()  # the link is down
        self._receiver: threading.Thread | None = None
        self._num_dropped = 0  # messages sent after the link went down

    # -- life cycle --------------------------------------------------------------------

    def launch(self) -> None:
        """Start the database process (it imports and connects while the model loads)."""
        ours, theirs = socket.socketpair()
        theirs_fd = theirs.fileno()
        self._process = subprocess.Popen(
            [sys.executable, "-m", "workers.db_process", str(theirs_fd)],
            pass_fds=[theirs_fd], close_fds=True)
        theirs.close()
        self._conn = Connection(ours.detach())
        # the worker's log level (its --loglevel) and GIL switch interval (its
        # --switch-interval), so both processes log and schedule their threads alike
        self._send(("init", self.settings, self.group_id, self.model,
                    logging.getLogger().getEffectiveLevel(), sys.getswitchinterval()))
        self._receiver = threading.Thread(target=self._receive, name="llmq-db-link",
                                          daemon=True)
        self._receiver.start()

    def start(self, timeout: float = READY_TIMEOUT_SECONDS) -> None:
        """Wait until the database process serves; raises when it does not."""
        if self._process is None:
            self.launch()
        if not self._ready.wait(timeout) or self._closed.is_set():
            code = self._process.poll() if self._process is not None else None
            self._kill()
            raise RuntimeError(f"the database process did not start (exit code {code}); "
                               "see its log lines above")

    def stop(self, timeout: float = 30.0) -> None:
        """Flush what is queued, then end the database process."""
        if self._process is None:
            return
        self._stopping = True
        if not self._closed.is_set():
            self._send(("stop", timeout))
        try:
            self._process.wait(timeout + 5.0)
        except subprocess.TimeoutExpired:
            logger.error("the database process of %s did not stop; killing it",
                         self.group_id)
            self._kill()
        self._closed.wait(5.0)

    def _kill(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()

    # -- DbWriter's calls --------------------------------------------------------------

    def progress(self, items: list[JobProgress]) -> None:
        if items:
            self._send(("progress", items))

    def finish(self, result: JobResult) -> None:
        self._send(("finish", result))

    def requeue(self, job_id: str, attempt: int, *, give_back: bool = True,
                send_message: bool = True) -> None:
        self._send(("requeue", job_id, attempt, give_back, send_message))

    def flush(self, timeout: float = 30.0) -> bool:
        """Block until everything sent before this call is written. False on timeout
        (or when the database process is gone)."""
        return self._ask("flush", timeout) is not None

    def owned(self) -> dict[str, int]:
        """Job id -> attempt of every job whose lease the group renews ({} when the
        database process does not answer)."""
        return self._ask("owned", REPLY_TIMEOUT_SECONDS) or {}

    # -- the link ----------------------------------------------------------------------

    def _send(self, message: tuple[Any, ...]) -> None:
        if self._closed.is_set() or self._conn is None:
            self._dropped(message[0], "")
            return
        try:
            with self._send_lock:
                self._conn.send(message)
        except OSError as exc:  # the receiver sees the EOF and reports it
            self._dropped(message[0], f" ({exc})")

    def _dropped(self, kind: str, why: str) -> None:
        """Say so once: a dead database process would otherwise log every result."""
        self._num_dropped += 1
        if self._num_dropped == 1 and not self._stopping:
            logger.error("the database process of %s is gone%s; dropping %s and every later "
                         "write (lease expiry gives the jobs to other groups)",
                         self.group_id, why, kind)

    def _ask(self, kind: str, timeout: float | None, *args: Any) -> Any:
        """Send `kind` and wait up to `timeout` (None: until the link goes down) for its
        reply; None without one."""
        token = next(self._tokens)
        waiter: list[Any] = [threading.Event(), None]
        with self._replies_lock:
            self._replies[token] = waiter
        try:
            # NOTE: registered first: a link that goes down from here on sets the waiter
            if self._closed.is_set():
                return None
            self._send((kind, token, timeout, *args))
            waiter[0].wait(timeout)
            return waiter[1]
        finally:
            with self._replies_lock:
                self._replies.pop(token, None)

    def _receive(self) -> None:
        name_this_thread()
        conn = self._conn
        assert conn is not None
        told_at: float | None = None  # when the health was last sent
        try:
            while True:
                now = time.monotonic()
                if told_at is None or now - told_at >= HEALTH_SECONDS:
                    self._send(("health", self._is_healthy()))
                    told_at = now
                if not conn.poll(HEALTH_SECONDS):
                    continue
                message = conn.recv()
                try:
                    self._handle(message)
                except Exception:  # a callback's failure must not end the link
                    logger.exception("group %s: handling %r from the database process "
                                     "failed", self.group_id, message[0])
        except (EOFError, OSError):
            pass
        finally:
            self._closed.set()
            with self._replies_lock:
                for waiter in self._replies.values():
                    waiter[0].set()
            if not self._stopping:
                code = self._process.wait() if self._process is not None else None
                reason = f"the database process exited (code {code})"
                logger.error("group %s: %s", self.group_id, reason)
                if self.on_exit is not None:
                    self.on_exit(reason)

    def _is_healthy(self) -> bool:
        """`healthy()`; False (leases run out) when it raises: this thread must live on,
        or the link would end and the group with it."""
        if self.healthy is None:
            return True
        try:
            return bool(self.healthy())
        except Exception:
            logger.exception("group %s: the health check raised; reporting unhealthy",
                             self.group_id)
            return False

    def _handle(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "ready":
            self._ready.set()
        elif kind == "lost":
            if self.on_lost is not None:
                self.on_lost(message[1], message[2])
        elif kind == "reply":
            with self._replies_lock:
                waiter = self._replies.get(message[1])
            if waiter is not None:
                waiter[1] = message[2]
                waiter[0].set()
        else:
            logger.error("the database process sent an unknown message %r", kind)


class RemoteClaims:
    """`JobClaims`'s calls (`workers.claims.Claims`), run by the database process."""

    def __init__(self, process: DbProcess) -> None:
        self._process = process

    def one(self, job_id: uuid.UUID) -> list[ClaimedRow]:
        return self._claim("one", job_id)

    def with_ahead(self, job_id: uuid.UUID, model: str, limit: int) -> list[ClaimedRow]:
        return self._claim("with_ahead", job_id, model, limit)

    def lines(self, model: str, limit: int) -> list[ClaimedRow]:
        return self._claim("lines", model, limit)

    def _claim(self, which: str, *args: Any) -> list[ClaimedRow]:
        # NOTE: no timeout: a claim given up on could still commit there, leaving rows
        # claimed and owned that nobody runs; the wait ends with the reply or the link
        reply = self._process._ask("claim", None, which, args)
        if reply is None:
            raise ClaimUnavailable("the database process is gone")
        outcome, value = reply
        if outcome != "rows":
            raise ClaimUnavailable(value)
        return value


# -- the database process --------------------------------------------------------------


class _DbService:
    """The database process: a `DbWriter` and `JobClaims` fed by the worker's messages."""

    def __init__(self, conn: Connection, settings: Settings, group_id: str,
                 model: str) -> None:
        from tasks.celery_app import create_celery, send_generate
        from tasks.db import create_db_engine, make_sessionmaker
        from tasks.redis_client import make_redis
        from tasks.streams.publish import EventPublisher
        from workers.claims import JobClaims, create_claims_engine
        from workers.db_writer import DbWriter

        self.conn = conn
        self.settings = settings
        self._send_lock = threading.Lock()
        self._health = (True, time.monotonic())
        # the writer's connection, its batch finisher's, and a little slack; the claim
        # threads' connections apart (create_claims_engine)
        self.db_engine = create_db_engine(settings.database_url, pool_size=2, max_overflow=2)
        self.claims_engine = create_claims_engine(settings.database_url, CLAIM_THREADS)
        session_factory = make_sessionmaker(self.db_engine)
        self.redis = make_redis(settings.redis_url)
        app = create_celery(settings)
        self.writer = DbWriter(
            settings, session_factory,
            EventPublisher(self.redis, settings).publish,
            lambda job_id: send_generate(app, settings, job_id, model), group_id,
            healthy=self._healthy, on_lost=self._on_lost)
        self.claims = JobClaims(settings, make_sessionmaker(self.claims_engine), self.redis,
                                group_id, own=self.writer.own)
        self._claim_pool = ThreadPoolExecutor(CLAIM_THREADS, thread_name_prefix="llmq-claims")

    def _send(self, message: tuple[Any, ...]) -> None:
        try:
            with self._send_lock:
                self.conn.send(message)
        except OSError:  # the worker is gone; the reader sees the EOF
            pass

    def _healthy(self) -> bool:
        healthy, when = self._health
        # NOTE: a worker that stopped telling (hung, or its link thread starved) is not
        # healthy: its leases run out instead of being held
        return healthy and time.monotonic() - when < 4 * HEALTH_SECONDS + 1.0

    def _on_lost(self, job_id: str, attempt: int) -> None:
        self._send(("lost", job_id, attempt))

    def serve(self) -> None:
        self.writer.start()
        self._send(("ready",))
        stop_timeout = 30.0
        try:
            while True:
                message = self.conn.recv()
                kind = message[0]
                if kind == "stop":
                    stop_timeout = message[1]
                    break
                self._dispatch(kind, message)
        except (EOFError, OSError):
            logger.warning("the worker of %s is gone; writing what is queued and exiting",
                           self.writer.group_id)
        self._claim_pool.shutdown(wait=True)
        self.writer.stop(stop_timeout)
        self.db_engine.dispose()
        self.claims_engine.dispose()
        self.redis.close()

    def _dispatch(self, kind: str, message: tuple[Any, ...]) -> None:
        writer = self.writer
        if kind == "health":
            self._health = (message[1], time.monotonic())
        elif kind == "finish":
            writer.finish(message[1])
        elif kind == "progress":
            writer.progress(message[1])
        elif kind == "requeue":
            writer.requeue(message[1], message[2], give_back=message[3],
                           send_message=message[4])
        elif kind == "claim":
            self._claim_pool.submit(self._claim, message[1], message[3], message[4])
        elif kind == "owned":
            self._send(("reply", message[1], writer.owned()))
        elif kind == "flush":
            token, timeout = message[1], message[2]
            done = writer.flush_marker()
            # NOTE: waited for in a thread: this loop keeps reading (health) meanwhile
            threading.Thread(target=self._reply_when_set, args=(token, done, timeout),
                             name="llmq-writer-flush", daemon=True).start()
        else:
            logger.error("unknown message %r from the worker", kind)

    def _claim(self, token: int, which: str, args: tuple[Any, ...]) -> None:
        name_this_thread()
        try:
            rows = getattr(self.claims, which)(*args)
        except Exception as exc:  # Postgres away: nothing was claimed; the caller retries
            logger.warning("claim %s%r failed: %s", which, args, exc)
            self._send(("reply", token, ("error", f"{type(exc).__name__}: {exc}")))
            return
        self._send(("reply", token, ("rows", rows)))

    def _reply_when_set(self, token: int, done: threading.Event, timeout: float) -> None:
        if done.wait(timeout):
            self._send(("reply", token, True))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=os.environ.get("LLMQ_LOG_LEVEL", "INFO").upper(),
                        format="%(asctime)s %(levelname)s %(name)s[db]: %(message)s")
    conn = Connection(int(argv[0]))
    try:
        kind, settings, group_id, model, log_level, switch_interval = conn.recv()
    except (EOFError, OSError):
        return 1
    if kind != "init":
        logger.error("the database process expected init, got %r", kind)
        return 1
    logging.getLogger().setLevel(log_level)
    # NOTE: an interactive job's claim waits here for the GIL while the writer thread runs
    # a transaction of batch results; Python's default 5 ms interval let that wait run long
    sys.setswitchinterval(switch_interval)
    threading.current_thread().name = "llmq-db-in"
    name_this_thread()
    _DbService(conn, settings, group_id, model).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
