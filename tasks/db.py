"""Database engine, sessions and migrations.

Postgres in compose and tests, SQLite as the embedded default. Callers build an engine
with `create_db_engine(url)` and sessions with `make_sessionmaker(engine)`; nothing here
runs at import time.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import resources
from pathlib import Path
from typing import Any, cast

import sqlalchemy
from sqlalchemy import CursorResult, event
from sqlalchemy.orm import Session, sessionmaker

logger = logging.getLogger(__name__)

# seconds a SQLite writer waits for the lock before giving up (web + worker + beat share it)
SQLITE_BUSY_TIMEOUT_MS = 10_000
# a pooled connection idle this long is pinged before it is handed out; one used more
# recently is handed out as it is (a busy process saves a round trip per checkout)
PING_AFTER_IDLE_SECONDS = 1.0


class DatabaseNotReady(RuntimeError):
    """The database is missing, unreachable or not at the newest schema; the message says
    what to do (one line, for a command-line user)."""


def utcnow() -> datetime:
    """The current time, timezone-aware UTC (every timestamp column is tz-aware)."""
    return datetime.now(UTC)


def has_passed(when: datetime | None, now: datetime | None = None) -> bool:
    """Whether the time `when` (a deadline, an expiry; None: never) is over. SQLite gives
    naive UTC times back."""
    if when is None:
        return False
    now = now or utcnow()
    return when.replace(tzinfo=when.tzinfo or now.tzinfo) < now


def create_db_engine(url: str, *, postgres_options: str | None = None,
                     **kwargs: Any) -> sqlalchemy.Engine:
    """An engine for `url` with connection checks on checkout (Postgres: of connections
    idle for `PING_AFTER_IDLE_SECONDS`, `_ping_idle_connections`). `postgres_options`:
    settings every Postgres connection starts with (libpq's `options`, `-c name=value`);
    SQLite has none.

    SQLite gets `check_same_thread=False` (threads share the engine),
    WAL journaling and a busy timeout so concurrent processes wait instead of failing.
    """
    if url.startswith("sqlite"):
        path = sqlite_path(url)
        if path is not None:
            # NOTE: SQLite creates the file but not its directory (e.g. a fresh state dir)
            path.parent.mkdir(parents=True, exist_ok=True)
        connect_args = dict(kwargs.pop("connect_args", {}))
        connect_args.setdefault("check_same_thread", False)
        connect_args.setdefault("timeout", SQLITE_BUSY_TIMEOUT_MS / 1000)
        engine = sqlalchemy.create_engine(
            url, pool_pre_ping=True, connect_args=connect_args, **kwargs
        )

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()

        return engine
    if url.startswith(("postgresql://", "postgres://")):
        # NOTE: psycopg 3 is the driver we ship; a bare postgresql:// would pick psycopg2.
        url = "postgresql+psycopg://" + url.split("://", 1)[1]
    kwargs.setdefault("pool_size", 10)
    kwargs.setdefault("max_overflow", 20)
    kwargs.setdefault("pool_recycle", 1800)
    connect_args = dict(kwargs.pop("connect_args", {}))
    connect_args.setdefault("connect_timeout", 5)
    if postgres_options:
        connect_args["options"] = postgres_options
    engine = sqlalchemy.create_engine(url, connect_args=connect_args, **kwargs)
    _ping_idle_connections(engine)
    return engine


def _ping_idle_connections(engine: sqlalchemy.Engine) -> None:
    """Ping a pooled connection on checkout when it has been idle for
    `PING_AFTER_IDLE_SECONDS`; a dead one is replaced before anyone uses it.

    NOTE: `pool_pre_ping` pings on every checkout: a round trip (and a wakeup of the
    server's backend) before each claim and each submission, while a process under load
    checks its connections out every few milliseconds. A server restart or a dropped
    connection shows up on a connection idle past the threshold; one that breaks within
    it fails its statement as a disconnect, which invalidates the whole pool (the caller
    answers 503 or retries, as for a server that goes away mid-statement).
    """
    dialect = engine.dialect

    @event.listens_for(engine, "checkin")
    def _checked_in(_dbapi_connection: Any, record: Any) -> None:
        record.info["idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _checked_out(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        idle_since = record.info.get("idle_since")  # None: a new connection
        if idle_since is None or time.monotonic() - idle_since < PING_AFTER_IDLE_SECONDS:
            return
        try:
            dialect.do_ping(dbapi_connection)
        except dialect.loaded_dbapi.Error as error:
            # as `pool_pre_ping` does: the pool drops every connection made before now
            # (a server restart ended them all) and checks out a new one
            raise sqlalchemy.exc.InvalidatePoolError(str(error)) from error


def sqlite_path(url: str) -> Path | None:
    """The file of a SQLite URL; None for other databases and in-memory SQLite."""
    try:
        parsed = sqlalchemy.make_url(url)
    except sqlalchemy.exc.ArgumentError:
        return None
    if parsed.get_backend_name() != "sqlite":
        return None
    database = parsed.database or ""
    if database in ("", ":memory:") or database.startswith("file:"):
        return None
    return Path(database)


def update_count(session: Session, statement: Any,
                 params: list[dict[str, Any]] | None = None) -> int:
    """Run an UPDATE/DELETE (once, or once per item of `params`: an executemany) and
    return how many rows it matched in all (conditional updates)."""
    result = cast("CursorResult[Any]", session.execute(statement, params))
    return int(result.rowcount)


def keyset_order(created: Any, row_id: Any, *, descending: bool = True) -> tuple[Any, Any]:
    """ORDER BY of a keyset-paged listing: (created, id), newest first by default; the id
    breaks ties between rows created in the same microsecond."""
    if descending:
        return created.desc(), row_id.desc()
    return created.asc(), row_id.asc()


def keyset_after(created: Any, row_id: Any, cursor: Any, *,
                 descending: bool = True) -> sqlalchemy.ColumnElement[bool]:
    """The rows after `cursor` (a row with `created_at` and `id`) in `keyset_order`."""
    if descending:
        return sqlalchemy.or_(created < cursor.created_at,
                              (created == cursor.created_at) & (row_id < cursor.id))
    return sqlalchemy.or_(created > cursor.created_at,
                          (created == cursor.created_at) & (row_id > cursor.id))


def make_sessionmaker(engine: sqlalchemy.Engine) -> sessionmaker[Session]:
    """Sessions that keep loaded attributes after commit (rows are read after the block)."""
    return sessionmaker(bind=engine, expire_on_commit=False)


def alembic_config(url: str) -> Any:
    """The Alembic config of the installed `migrations` package, pointed at `url`."""
    from alembic.config import Config

    package_dir = resources.files("migrations")
    config = Config(str(package_dir / "alembic.ini"))
    config.set_main_option("script_location", str(package_dir))
    # NOTE: ConfigParser interpolates '%'; URL-encoded passwords carry '%'.
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    config.attributes["configure_logger"] = False
    return config


@dataclass(frozen=True)
class AppliedMigration:
    """One migration `upgrade_database` applied: its revision, the one before it (None for
    the first) and its title (the first line of its docstring)."""

    revision: str
    down_revision: str | None
    title: str

    def __str__(self) -> str:
        start = f"{self.down_revision} " if self.down_revision else ""
        return f"{start}-> {self.revision}, {self.title}"


def current_revision(url: str) -> str | None:
    """The schema revision the database at `url` is at (None: no schema yet)."""
    from alembic.migration import MigrationContext

    migration_log = logging.getLogger("alembic.runtime.migration")
    level = migration_log.level
    migration_log.setLevel(logging.WARNING)  # a look, not news ("Context impl ...")
    engine = create_db_engine(url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()
        migration_log.setLevel(level)


def upgrade_database(url: str, *, quiet: bool = False) -> list[AppliedMigration]:
    """Migrate the database at `url` to the newest schema (`alembic upgrade head`).
    Returns the migrations applied, oldest first ([] when it was at the newest), read from
    the migrations' own graph between the revision before and the one after. `quiet`: log
    none of it (the caller says it in its own words)."""
    # NOTE: alembic announces each of its own plugins at INFO when it is imported; only
    # the migrations it applies are worth a line
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)
    from alembic import command
    from alembic.script import ScriptDirectory

    config = alembic_config(url)
    migration_log = logging.getLogger("alembic.runtime.migration")
    level = migration_log.level
    # (INFO where not quiet: a schema check may have set it to WARNING in this process)
    migration_log.setLevel(logging.WARNING if quiet else logging.INFO)
    try:
        before = current_revision(url)
        if not quiet:
            logger.info("upgrading database schema at %s", _redact(url))
        command.upgrade(config, "head")
        after = current_revision(url)
    finally:
        migration_log.setLevel(level)
    if after == before:
        return []
    scripts = ScriptDirectory.from_config(config)
    # newest first, from `after` down to (not including) `before`
    steps = list(scripts.iterate_revisions(after, before))
    return [AppliedMigration(
        step.revision,
        # (a merge has several: written as one, comma-separated)
        ",".join(step.down_revision) if isinstance(step.down_revision, tuple | list)
        else step.down_revision,
        step.doc.strip().splitlines()[0] if step.doc and step.doc.strip() else "")
        for step in reversed(steps)]


def check_schema(url: str, upgrade_command: str = "llmq db upgrade") -> None:
    """Raise `DatabaseNotReady` unless the database at `url` exists, answers and is at the
    newest schema. Never creates anything (a missing SQLite file stays missing)."""
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)  # a check, not news
    from alembic.script import ScriptDirectory

    where = _redact(url)
    path = sqlite_path(url)
    if path is not None and not path.exists():
        raise DatabaseNotReady(f"no database at {path.resolve()}: run `{upgrade_command}` "
                               "first (or start `llmq up` on the same state directory)")
    try:
        current = current_revision(url)
    except sqlalchemy.exc.DBAPIError as exc:
        reason = str(exc.orig).strip().splitlines()[0] if exc.orig else type(exc).__name__
        raise DatabaseNotReady(f"cannot reach the database at {where}: {reason}") from None
    head = ScriptDirectory.from_config(alembic_config(url)).get_current_head()
    if current != head:
        raise DatabaseNotReady(
            f"the database at {where} is not migrated (schema {current or 'empty'}, newest "
            f"{head}): run `{upgrade_command}`")


def _redact(url: str) -> str:
    try:
        return sqlalchemy.make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - only used in a log line
        return "<database url>"
