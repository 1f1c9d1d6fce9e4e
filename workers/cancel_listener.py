"""Cancel requests for running jobs: the web PUBLISHes the job id on the cancel channel
(after setting the job's cancel flag key); this thread hands every id to the batcher,
which applies it between steps if the job is its own. The flag key covers the window
before a job reaches the batcher: `generate` checks it at admission.

The same connection listens for the model's batch lines (`batch_lines_channel`): a web
process announces a validated batch there, and the listener wakes the batch feeder.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

from tasks.protocol import batch_lines_channel, cancel_channel
from tasks.settings import Settings
from workers.thread_names import name_this_thread

logger = logging.getLogger(__name__)


class Subscription(Protocol):
    """One pub/sub connection (`redis.client.PubSub`)."""

    def subscribe(self, *channels: str) -> None: ...

    def get_message(self, ignore_subscribe_messages: bool = False,
                    timeout: float = 0.0) -> dict[str, Any] | None: ...

    def close(self) -> None: ...


class PubSubClient(Protocol):
    """The Redis client the listener subscribes with (`redis.Redis`)."""

    def pubsub(self) -> Subscription: ...


class CancelListener:
    """A daemon thread subscribed to `cancel_channel` (and, given a model and
    `on_batch_lines`, to its `batch_lines_channel`); reconnects on Redis errors."""

    def __init__(self, redis: PubSubClient, settings: Settings,
                 on_cancel: Callable[[str], None], *, model: str | None = None,
                 on_batch_lines: Callable[[], None] | None = None) -> None:
        self.redis = redis
        self.settings = settings
        self.on_cancel = on_cancel
        self.batch_channel = (batch_lines_channel(settings, model)
                              if model is not None and on_batch_lines is not None else None)
        self.on_batch_lines = on_batch_lines
        self._stop = threading.Event()
        self._subscribed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llmq-cancel-listener",
                                        daemon=True)

    def start(self, timeout: float = 10.0) -> None:
        """Start and wait until subscribed, so no cancel published after this is missed."""
        self._thread.start()
        if not self._subscribed.wait(timeout):
            logger.warning("cancel listener not subscribed after %.0fs; retrying in background",
                           timeout)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def _run(self) -> None:
        name_this_thread()
        channels = [cancel_channel(self.settings)]
        if self.batch_channel is not None:
            channels.append(self.batch_channel)
        backoff = 0.1
        while not self._stop.is_set():
            pubsub = self.redis.pubsub()
            try:
                pubsub.subscribe(*channels)
                confirmed = 0
                while not self._stop.is_set():
                    message = pubsub.get_message(timeout=0.5)
                    if message is None:
                        continue
                    if message.get("type") == "subscribe":
                        confirmed += 1
                        if confirmed == len(channels):
                            self._subscribed.set()  # confirmed: later publishes reach us
                    if message.get("type") != "message":
                        continue
                    if self.on_batch_lines is not None and _text(
                            message.get("channel")) == self.batch_channel:
                        self.on_batch_lines()
                        continue
                    job_id = _text(message["data"])
                    logger.debug("cancel requested for job %s", job_id)
                    self.on_cancel(job_id.strip())
                    backoff = 0.1
            except Exception:  # reconnect and keep listening
                logger.warning("cancel listener lost Redis; reconnecting in %.1fs", backoff,
                               exc_info=True)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
            finally:
                try:
                    pubsub.close()
                except Exception:
                    pass


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
