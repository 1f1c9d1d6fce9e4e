"""Where a command finds its state: the same database (and state directory) as `llmq up`.

Every command that touches the database takes `--state-dir` and `--database-url`. The
database is, first found: `--database-url`, `LLMQ_DATABASE_URL`, then SQLite in the state
directory (`--state-dir`, `LLMQ_STATE_DIR`, `./.llmq`). So `llmq keys create NAME` run
where `llmq up` runs writes to the database `llmq up` serves.

`StateLock` keeps a second `llmq up` off a state directory that one already uses.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import IO

from tasks.settings import DEFAULT_STATE_DIR, Settings, sqlite_url_in


def add_state_flags(parser: argparse.ArgumentParser) -> None:
    """`--state-dir` and `--database-url`, shared by every command that reads the database."""
    parser.add_argument("--state-dir", default=None, metavar="DIR",
                        help="llmq up's state directory; its llmq.db is the default "
                        f"database (default: $LLMQ_STATE_DIR or ./{DEFAULT_STATE_DIR})")
    parser.add_argument("--database-url", default=None, metavar="URL",
                        help="the database (default: $LLMQ_DATABASE_URL, else "
                        "sqlite:///<state dir>/llmq.db)")


def state_dir_of(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    return Path(getattr(args, "state_dir", None) or env.get("LLMQ_STATE_DIR")
                or DEFAULT_STATE_DIR).resolve()


def database_url_of(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> str:
    """`--database-url`, else `LLMQ_DATABASE_URL`, else SQLite in the state directory."""
    env = os.environ if environ is None else environ
    return (getattr(args, "database_url", None) or env.get("LLMQ_DATABASE_URL")
            or sqlite_url_in(str(state_dir_of(args, env))))


def settings_of(args: argparse.Namespace) -> Settings:
    """The environment's settings with the command's state flags applied."""
    return Settings.from_env(state_dir=str(state_dir_of(args)),
                             database_url=database_url_of(args))


def upgrade_command(args: argparse.Namespace) -> str:
    """`llmq db upgrade` with the flags that point it at the same database as `args`."""
    words = ["llmq", "db", "upgrade"]
    if getattr(args, "database_url", None):
        words += ["--database-url", args.database_url]
    elif getattr(args, "state_dir", None):
        words += ["--state-dir", args.state_dir]
    return shlex.join(words)


class StateLockedError(RuntimeError):
    """Another `llmq up` holds the state directory."""


class StateLock:
    """An exclusive lock on `<state dir>/up.lock`, held while `llmq up` runs.

    NOTE: `flock` is released by the kernel when the holder exits however it exits, so a
    crashed `llmq up` never leaves a stale lock; the pid in the file is for the message.
    """

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / "up.lock"
        self._file: IO[str] | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(self.path, "a+")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "?"
            handle.close()
            raise StateLockedError(
                f"another llmq up (pid {holder}) is running with state directory "
                f"{self.path.parent}; stop it first, or pass a different --state-dir") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        self._file = handle

    def release(self) -> None:
        if self._file is not None:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
            self._file.close()
            self._file = None
