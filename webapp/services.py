"""What the views share: database sessions, Redis, the Celery sender, the model registry.

Built once per app by `create_app`; opening the objects connects to nothing, so the app
starts (and answers /health) while Postgres or Redis are still coming up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import sqlalchemy
from celery import Celery
from flask import Flask, current_app
from redis import Redis
from sqlalchemy.orm import Session, sessionmaker

from tasks.celery_app import create_celery
from tasks.db import create_db_engine, make_sessionmaker
from tasks.redis_client import make_redis
from tasks.settings import Settings
from tasks.streams.publish import EventPublisher
from tasks.streams.reader import EventSubscriber
from webapp.model_registry import ModelRegistry

EXTENSION_KEY = "llmq"


@dataclass(slots=True)
class Services:
    settings: Settings
    engine: sqlalchemy.Engine
    # the same pool, each statement its own transaction: a one-statement write needs no
    # BEGIN and COMMIT round trips (a job's submission)
    autocommit: sqlalchemy.Engine
    session_factory: sessionmaker[Session]
    # sessions on `autocommit`, for the views that only read (a job's row, an API key, a
    # listing): one round trip per statement, where a transaction adds a BEGIN before the
    # first and a ROLLBACK after the last
    reads: sessionmaker[Session]
    redis: Redis
    celery: Celery
    models: ModelRegistry
    publisher: EventPublisher
    subscriber: EventSubscriber
    # stopped first by close(): the app's background threads (the batch validator)
    on_close: list[Callable[[], None]] = field(default_factory=list)

    @classmethod
    def build(cls, settings: Settings) -> Services:
        engine = create_db_engine(settings.database_url)
        autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
        redis = make_redis(settings.redis_url)
        return cls(
            settings=settings,
            engine=engine,
            autocommit=autocommit,
            session_factory=make_sessionmaker(engine),
            reads=make_sessionmaker(autocommit),
            redis=redis,
            celery=create_celery(settings),
            models=ModelRegistry(settings),
            publisher=EventPublisher(redis, settings),
            subscriber=EventSubscriber(redis, settings),
        )

    def init_app(self, app: Flask) -> None:
        app.extensions[EXTENSION_KEY] = self

    def close(self) -> None:
        for stop in self.on_close:
            stop()
        self.subscriber.close()
        self.redis.close()
        self.engine.dispose()


def services() -> Services:
    """The services of the current app (inside a request or app context)."""
    return current_app.extensions[EXTENSION_KEY]
