"""The heartbeat through a Redis outage: one warning when it starts, one when it ends."""

from __future__ import annotations

import logging
import socket
import time

import redis

from tasks.protocol import groups_key
from workers.heartbeat import GroupIdentity, Heartbeat


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for(condition, message: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, message
        time.sleep(0.05)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_an_outage_is_logged_once_and_its_end_once(service_settings, redis_client):
    unreachable = redis.Redis(host="127.0.0.1", port=_closed_port(), socket_connect_timeout=0.2)
    identity = GroupIdentity(group_id="g-outage", model="m", devices=["cpu"], capacity=1,
                             max_model_len=64, max_num_batched_tokens=64, block_size=16)
    beat = Heartbeat(unreachable, service_settings, identity, dict, interval=0.05)
    caplog = _Lines()
    logging.getLogger("workers.heartbeat").addHandler(caplog)
    beat._thread.start()
    try:
        _wait_for(lambda: caplog.records, "the outage was not logged")
        time.sleep(1.0)  # many more failed beats
        failures = [r for r in caplog.records if "failed" in r.getMessage()]
        assert len(failures) == 1, [r.getMessage() for r in caplog.records]
        assert failures[0].exc_info is None  # a line, not a traceback per beat
        beat.redis = redis_client  # Redis is back
        _wait_for(lambda: any("is back" in r.getMessage() for r in caplog.records),
                  "the recovery was not logged")
        assert redis_client.hget(groups_key(service_settings, "m"), "g-outage")
    finally:
        beat.stop()
        logging.getLogger("workers.heartbeat").removeHandler(caplog)
