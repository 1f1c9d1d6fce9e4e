"""What the benchmarks that run against Postgres and Redis share: their flags, and a
throwaway database and key prefix that are removed afterwards, whatever happened."""

from __future__ import annotations

import argparse
import os
import uuid
from dataclasses import dataclass


def add_service_args(parser: argparse.ArgumentParser) -> None:
    """`--postgres-url` (an admin URL: a database is created beside it), `--redis-url`,
    `--json` (also write the figures to this file)."""
    parser.add_argument("--postgres-url", default=os.environ.get(
        "LLMQ_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"))
    parser.add_argument("--redis-url", default=os.environ.get(
        "LLMQ_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--json", help="also write the figures to this file")


@dataclass(slots=True)
class Scratch:
    """A migrated database and a Redis key prefix of one benchmark run."""

    admin_url: str
    db_name: str
    database_url: str
    redis_url: str
    redis_prefix: str


def create_scratch(postgres_url: str, redis_url: str) -> Scratch:
    import psycopg

    from tasks.db import upgrade_database

    db_name = f"llmq_bench_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{db_name}"')
    scratch = Scratch(postgres_url, db_name, postgres_url.rsplit("/", 1)[0] + "/" + db_name,
                      redis_url, f"llmqbench{uuid.uuid4().hex[:8]}")
    try:
        upgrade_database(scratch.database_url)
    except BaseException:
        drop_scratch(scratch)
        raise
    return scratch


def drop_scratch(scratch: Scratch) -> None:
    """Delete the run's Redis keys and drop its database."""
    import psycopg

    from tasks.redis_client import make_redis

    redis = make_redis(scratch.redis_url)
    try:
        keys = list(redis.scan_iter(match=scratch.redis_prefix + "*", count=1000))
        for start in range(0, len(keys), 500):
            redis.delete(*keys[start:start + 500])
    finally:
        redis.close()
    with psycopg.connect(scratch.admin_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{scratch.db_name}" WITH (FORCE)')
