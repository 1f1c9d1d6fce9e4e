"""Settings from the environment, Redis names, the Celery app and the database setup."""

from __future__ import annotations

import json
import logging
import time
import uuid

import pytest
import sqlalchemy

from tasks.celery_app import create_celery, maintenance_queue, send_generate
from tasks.db import (
    alembic_config,
    create_db_engine,
    current_revision,
    upgrade_database,
    utcnow,
)
from tasks.protocol import (
    BATCH_SWEEP_TASK,
    EXPIRE_STREAMS_TASK,
    GENERATE_TASK,
    RECLAIM_TASK,
    RESEND_QUEUED_TASK,
    batch_progress_key,
    cancel_flag_key,
    events_key,
    group_alive_key,
)
from tasks.settings import Settings


def test_from_env_parses_types_and_names_the_bad_variable():
    settings = Settings.from_env({
        "LLMQ_MODELS": "demo=/ckpt/a, other=/ckpt/b",
        "LLMQ_AUTH_ENABLED": "true",
        "LLMQ_MAX_ATTEMPTS": "5",
        "LLMQ_LEASE_SECONDS": "12.5",
        "LLMQ_MAX_MODEL_LEN": "none",
        "LLMQ_KV_TIERS": "redis://h:1/2,file:///tmp/kv",
    })
    assert settings.models == {"demo": "/ckpt/a", "other": "/ckpt/b"}
    assert settings.auth_enabled is True and settings.max_attempts == 5
    assert settings.lease_seconds == 12.5 and settings.max_model_len is None
    assert settings.kv_tiers == ("redis://h:1/2", "file:///tmp/kv")
    with pytest.raises(ValueError, match="LLMQ_AUTH_ENABLED"):
        Settings.from_env({"LLMQ_AUTH_ENABLED": "maybe"})
    with pytest.raises(ValueError, match="LLMQ_MODELS"):
        Settings.from_env({"LLMQ_MODELS": "no-path"})
    # the stream interval: 0 (every step's tokens) up to 1 s; anything else is refused
    assert Settings.from_env({"LLMQ_STREAM_INTERVAL_SECONDS": "0"}).stream_interval_seconds == 0
    for bad in ("-0.01", "1.5", "1e9", "nan", "soon"):
        with pytest.raises(ValueError, match="LLMQ_STREAM_INTERVAL_SECONDS"):
            Settings.from_env({"LLMQ_STREAM_INTERVAL_SECONDS": bad})
    # the batcher's nice value: Linux's range, -20 to 19; anything else is refused at start
    assert Settings.from_env({"LLMQ_BATCHER_NICE": "-20"}).batcher_nice == -20
    assert Settings.from_env({}).batcher_nice == -20
    for bad in ("-21", "20", "99999999999", "0.5", "high"):
        with pytest.raises(ValueError, match="LLMQ_BATCHER_NICE"):
            Settings.from_env({"LLMQ_BATCHER_NICE": bad})
    # a running batch's shared figures: 0 (a pass at every read) up to a minute
    assert Settings.from_env(
        {"LLMQ_BATCH_PROGRESS_CACHE_SECONDS": "0"}).batch_progress_cache_seconds == 0
    for bad in ("-1", "61", "1e9", "nan", "soon"):
        with pytest.raises(ValueError, match="LLMQ_BATCH_PROGRESS_CACHE_SECONDS"):
            Settings.from_env({"LLMQ_BATCH_PROGRESS_CACHE_SECONDS": bad})


def test_redis_names_live_under_the_prefix():
    settings = Settings(redis_prefix="p1")
    assert events_key(settings, "j") == "p1:job:j:events"
    assert cancel_flag_key(settings, "j") == "p1:job:j:cancel"
    assert batch_progress_key(settings, "batch_b") == "p1:batch:batch_b:progress"
    assert group_alive_key(settings, "m", "g0") == "p1:groups:m:g0:alive"
    assert settings.queue_for("m") == "p1.model.m"


def test_celery_app_config_and_beat_schedule():
    settings = Settings(redis_prefix="p2", lease_renew_seconds=3.0)
    app = create_celery(settings)
    assert app.conf.broker_transport_options["global_keyprefix"] == "p2:celery:"
    assert app.conf.task_ignore_result is True
    assert app.conf.worker_prefetch_multiplier == 1
    assert app.conf.task_acks_late is False
    assert app.conf.accept_content == ["json"]
    assert not app.conf.beat_schedule
    schedule = create_celery(settings, beat=True).conf.beat_schedule
    tasks = {entry["task"]: entry["schedule"] for entry in schedule.values()}
    assert tasks == {RECLAIM_TASK: 3.0, RESEND_QUEUED_TASK: 15.0, EXPIRE_STREAMS_TASK: 60.0,
                     BATCH_SWEEP_TASK: 5.0}
    assert app.conf.task_routes[RECLAIM_TASK]["queue"] == maintenance_queue(settings)


def test_send_generate_lands_on_the_model_queue_in_the_prefixed_keyspace(
    service_settings, redis_client
):
    app = create_celery(service_settings)
    job_id = str(uuid.uuid4())
    send_generate(app, service_settings, job_id, "tiny")
    queue_key = f"{service_settings.redis_prefix}:celery:{service_settings.queue_for('tiny')}"
    raw = redis_client.lpop(queue_key)
    assert raw is not None, f"no message in {queue_key}"
    message = json.loads(raw)
    assert message["headers"]["task"] == GENERATE_TASK
    assert message["headers"]["argsrepr"] == repr([job_id])
    assert message["content-type"] == "application/json"


def test_a_channel_keeps_one_client_for_its_plain_commands_while_its_pool_lives(
    service_settings, redis_client
):
    """Kombu built a redis-py client per publish (a fifth of `send_task`'s CPU); the
    channel now keeps one, and builds another when kombu replaces its pool."""
    app = create_celery(service_settings)
    model = f"probe-{uuid.uuid4().hex[:8]}"  # a queue of its own: other tests send to 'tiny'
    queue_key = f"{service_settings.redis_prefix}:celery:{service_settings.queue_for(model)}"
    with app.connection_for_write() as connection:
        channel = connection.default_channel
        first = channel._create_client()
        assert channel._create_client() is first
        assert channel._create_client(asynchronous=True) is not first
        channel._disconnect_pools()  # as kombu does after a fork or a lost connection
        second = channel._create_client()
        assert second is not first and second.connection_pool is channel.pool
    job_ids = [str(uuid.uuid4()) for _ in range(3)]
    for job_id in job_ids:
        send_generate(app, service_settings, job_id, model)
    sent = [json.loads(raw)["headers"]["argsrepr"]
            for raw in redis_client.lrange(queue_key, 0, -1)]
    redis_client.delete(queue_key)
    assert sorted(sent) == sorted(repr([job_id]) for job_id in job_ids)


def test_upgrade_reports_only_the_migrations_it_applied(tmp_path, caplog):
    """A database part way up the migrations: the upgrade names exactly the rest, in
    order, whatever alembic's own log says (quiet: it says nothing)."""
    from alembic import command

    url = f"sqlite:///{tmp_path / 'llmq.db'}"
    assert current_revision(url) is None
    command.upgrade(alembic_config(url), "0005")
    assert current_revision(url) == "0005"
    caplog.clear()
    with caplog.at_level(logging.INFO):
        applied = upgrade_database(url, quiet=True)
    assert [step.revision for step in applied][:2] == ["0006", "0007"]
    assert applied[0].down_revision == "0005"
    assert current_revision(url) == applied[-1].revision
    assert not [r for r in caplog.records if r.name.startswith("alembic")]


def test_sqlite_engine_migrates_and_uses_wal(tmp_path):
    url = f"sqlite:///{tmp_path / 'llmq.db'}"
    applied = upgrade_database(url, quiet=True)
    assert len(applied) >= 9 and str(applied[0]).startswith("-> 0001, ")
    assert str(applied[1]).startswith("0001 -> 0002, ")
    assert [step.revision for step in applied] == [
        f"{i:04d}" for i in range(1, len(applied) + 1)]
    assert [step.down_revision for step in applied] == [
        None, *(step.revision for step in applied[:-1])]
    assert all(step.title for step in applied)
    assert upgrade_database(url) == []  # idempotent
    assert current_revision(url) == applied[-1].revision
    engine = create_db_engine(url)
    with engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        tables = set(sqlalchemy.inspect(conn).get_table_names())
    assert {"jobs", "api_keys", "alembic_version"} <= tables
    engine.dispose()
    assert utcnow().tzinfo is not None


def test_migration_matches_the_models(service_settings, db_engine):
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from tasks.models import Base

    with db_engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diff == [], f"models and migrations differ; add a revision: {diff}"


def test_every_cli_command_has_help():
    import subprocess
    import sys

    for command in ([], ["web"], ["beat"], ["db", "upgrade"], ["keys", "create"],
                    ["keys", "list"], ["make-model"], ["submit"], ["batch"],
                    ["batch", "submit"], ["batch", "status"], ["batch", "results"]):
        result = subprocess.run([sys.executable, "-m", "llmq.cli", *command, "--help"],
                                capture_output=True, text=True, check=False, timeout=60)
        assert result.returncode == 0, (command, result.stderr)
        assert "usage: llmq" in result.stdout


def test_a_pooled_connection_is_pinged_only_after_idling_and_a_dead_one_is_replaced(
        service_settings, monkeypatch):
    import tasks.db

    monkeypatch.setattr(tasks.db, "PING_AFTER_IDLE_SECONDS", 0.3)
    engine = create_db_engine(service_settings.database_url, pool_size=1, max_overflow=0)
    pings: list[object] = []
    real_ping = engine.dialect.do_ping
    monkeypatch.setattr(engine.dialect, "do_ping",
                        lambda connection: pings.append(connection) or real_ping(connection))
    try:
        with engine.connect() as conn:
            first_pid = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar()
        for _ in range(3):  # checked out again at once: handed out without a round trip
            with engine.connect() as conn:
                assert conn.exec_driver_sql("SELECT pg_backend_pid()").scalar() == first_pid
        assert pings == []
        time.sleep(0.4)
        with engine.connect() as conn:  # idle past the threshold: pinged, still alive
            assert conn.exec_driver_sql("SELECT pg_backend_pid()").scalar() == first_pid
        assert len(pings) == 1
        killer = create_db_engine(service_settings.database_url)  # ends the pooled backend
        with killer.connect() as conn:
            assert conn.exec_driver_sql(
                f"SELECT pg_terminate_backend({first_pid})").scalar() is True
        killer.dispose()
        time.sleep(0.4)
        with engine.connect() as conn:  # the dead one is replaced before anyone uses it
            assert conn.exec_driver_sql("SELECT pg_backend_pid()").scalar() != first_pid
        assert len(pings) == 2
    finally:
        engine.dispose()
