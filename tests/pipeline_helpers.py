"""Helpers for the batcher and pipeline tests: job rows, streams, worker processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
from sqlalchemy import select

from tasks.db import utcnow
from tasks.models import Job, JobStatus
from tasks.protocol import JobEvent, events_key, group_alive_key, groups_key
from tasks.settings import Settings

REPO = Path(__file__).resolve().parent.parent


def insert_job(session_factory: Any, *, model: str = "tiny", prompt: str | None = "hello",
               prompt_token_ids: list[int] | None = None, params: dict[str, Any] | None = None,
               priority: int = 0) -> str:
    """A queued job row, as the web writes it; returns its id."""
    job_id = uuid.uuid4()
    with session_factory.begin() as session:
        session.add(Job(
            id=job_id, model=model, kind="completion", prompt=prompt,
            prompt_token_ids=prompt_token_ids, params=params or {"max_tokens": 8},
            priority=priority, status=JobStatus.QUEUED.value, attempts=0, created_at=utcnow(),
        ))
    return str(job_id)


def read_job(session_factory: Any, job_id: str) -> Job:
    with session_factory() as session:
        return session.execute(select(Job).where(Job.id == uuid.UUID(job_id))).scalar_one()


def read_stream(redis: Any, settings: Settings, job_id: str) -> list[tuple[str, JobEvent]]:
    entries = redis.xrange(events_key(settings, job_id))
    return [(_text(entry_id), JobEvent.from_fields(fields)) for entry_id, fields in entries]


def read_ended_stream(redis: Any, settings: Settings, job_id: str,
                      timeout: float = 10.0) -> list[JobEvent]:
    """The job's stream once its terminal event is in it. A group's writer commits a
    terminal row BEFORE it publishes the event (workers/db_writer.py), so a test that saw
    the row end may read the stream a moment too early."""
    def stream_if_ended() -> list[JobEvent] | None:
        events = [event for _, event in read_stream(redis, settings, job_id)]
        return events if any(e.type.is_terminal for e in events) else None

    return wait_for(stream_if_ended, timeout, f"job {job_id}'s terminal event")


def wait_for(check: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll `check` until it returns something truthy; fail the test after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def wait_terminal(session_factory: Any, job_id: str, timeout: float = 60.0) -> Job:
    return wait_for(
        lambda: (lambda job: job if JobStatus(job.status).is_terminal else None)(
            read_job(session_factory, job_id)),
        timeout, f"job {job_id} to end",
    )


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


# --- worker processes -----------------------------------------------------------------


def worker_env(settings: Settings, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "LLMQ_DATABASE_URL": settings.database_url,
        "LLMQ_REDIS_URL": settings.redis_url,
        "LLMQ_REDIS_PREFIX": settings.redis_prefix,
        "LLMQ_MODELS": ",".join(f"{k}={v}" for k, v in settings.models.items()),
        "LLMQ_LEASE_SECONDS": str(settings.lease_seconds),
        "LLMQ_LEASE_RENEW_SECONDS": str(settings.lease_renew_seconds),
        "LLMQ_DRAIN_GRACE_SECONDS": str(settings.drain_grace_seconds),
        "PYTHONPATH": str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
        # one intra-op thread per worker: two workers share this machine's cores
        "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
    })
    env.update(extra)
    return env


class WorkerProcess:
    """A real `python -m workers.main` process; its log goes to `log_path`.

    Its batcher keeps the default priority (`LLMQ_BATCHER_NICE=0`) unless `extra_env` says
    otherwise: test workers share the host with the other test process and with each
    other, and the fault tests' timings (a job seen generating is still running when a
    fault lands) hold for batchers that do not run ahead of the database process."""

    def __init__(self, settings: Settings, group_id: str, log_dir: Path, *,
                 model: str = "tiny", args: list[str] | None = None,
                 extra_env: dict[str, str] | None = None) -> None:
        self.settings = settings
        self.group_id = group_id
        self.model = model
        self.log_path = log_dir / f"worker-{group_id}.log"
        command = [sys.executable, "-m", "workers.main", "--model-name", model,
                   "--group-id", group_id, "--heartbeat-seconds", "0.5", *(args or [])]
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(command, cwd=REPO,
                                        env=worker_env(settings, **{
                                            "LLMQ_BATCHER_NICE": "0", **(extra_env or {})}),
                                        stdout=self._log, stderr=subprocess.STDOUT)

    def heartbeat(self, redis: Any) -> dict[str, Any] | None:
        if not redis.exists(group_alive_key(self.settings, self.model, self.group_id)):
            return None
        raw = redis.hget(groups_key(self.settings, self.model), self.group_id)
        return json.loads(raw) if raw else None

    def wait_ready(self, redis: Any, timeout: float = 90.0) -> dict[str, Any]:
        def ready() -> dict[str, Any] | None:
            if self.process.poll() is not None:
                raise AssertionError(f"worker {self.group_id} exited with "
                                     f"{self.process.returncode}:\n{self.log_tail()}")
            return self.heartbeat(redis)
        return wait_for(ready, timeout, f"worker {self.group_id} heartbeat", interval=0.2)

    def log_tail(self, num_chars: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def kill(self) -> None:
        """SIGKILL: no drain, no cleanup (a crashed machine)."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM (drain) and wait; SIGKILL if it does not exit in time."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self._log.close()
        return self.process.returncode


def process_threads(pid: int) -> Iterator[tuple[str, Path, list[str]]]:
    """(name, /proc task directory, stat fields after the name) of each live thread of
    process `pid`; nothing where /proc is missing."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return
    for task in tasks:
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue  # the thread ended
        yield (stat[stat.index("(") + 1:stat.rindex(")")], task,
               stat[stat.rindex(")") + 2:].split())


def thread_nice(pid: int, name: str) -> int:
    """The nice value of process `pid`'s thread named `name` (Linux: /proc)."""
    for thread_name, _, fields in process_threads(pid):
        if thread_name == name:
            return int(fields[16])  # the stat's 19th field
    raise AssertionError(f"process {pid} has no thread named {name!r}")


def expected_batcher_nice(requested: int, engine_threads: int, worker_pid: int) -> int:
    """The nice value a worker's batcher should run at with `LLMQ_BATCHER_NICE=requested`:
    its rule (workers/thread_priority.py), where this user may raise a thread's priority."""
    from workers.thread_priority import batcher_nice, set_this_thread_nice

    wanted, _ = batcher_nice(requested, engine_threads, len(os.sched_getaffinity(worker_pid)))
    allowed: list[bool] = []
    probe = threading.Thread(target=lambda: allowed.append(set_this_thread_nice(-1)))
    probe.start()
    probe.join()
    return wanted if wanted >= 0 or allowed[0] else 0


@contextmanager
def running_worker(settings: Settings, redis: Any, log_dir: Path, name: str,
                   **kwargs: Any) -> Iterator[WorkerProcess]:
    """A worker process named `name-<random>`, ready (heartbeating) until the block ends."""
    worker = WorkerProcess(settings, f"{name}-{uuid.uuid4().hex[:4]}", log_dir, **kwargs)
    try:
        worker.wait_ready(redis)
        yield worker
    finally:
        worker.terminate()


# --- HTTP / SSE -------------------------------------------------------------------------


@dataclass(slots=True)
class SseEvent:
    id: str | None
    event: str
    data: dict[str, Any]
    received_at: float  # time.time() when its last line arrived


def iter_sse(base_url: str, job_id: str, last_event_id: str | None = None,
             timeout: float = 60.0) -> Iterator[SseEvent]:
    """The job's server-sent events, parsed, up to and including the terminal one."""
    headers = {"Accept": "text/event-stream"}
    if last_event_id:
        headers["Last-Event-ID"] = last_event_id
    with requests.get(f"{base_url}/v1/jobs/{job_id}/events", headers=headers, stream=True,
                      timeout=timeout) as response:
        response.raise_for_status()
        fields: dict[str, str] = {}
        for raw in response.iter_lines(decode_unicode=True):
            line = raw if isinstance(raw, str) else raw.decode()
            if line:
                if line.startswith(":"):
                    continue
                name, _, value = line.partition(":")
                fields[name] = value[1:] if value.startswith(" ") else value
                continue
            if "event" in fields:
                event = SseEvent(fields.get("id"), fields["event"],
                                 json.loads(fields.get("data") or "{}"), time.time())
                yield event
                if event.event in TERMINAL_EVENTS:
                    return
            fields = {}


TERMINAL_EVENTS = ("done", "error", "cancelled")


def submit(base_url: str, **body: Any) -> dict[str, Any]:
    body.setdefault("model", "tiny")
    response = requests.post(f"{base_url}/v1/jobs", json=body, timeout=30)
    assert response.status_code == 202, response.text
    return response.json()


def get_job(base_url: str, job_id: str) -> dict[str, Any]:
    response = requests.get(f"{base_url}/v1/jobs/{job_id}", timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


@contextmanager
def serving_web(command: list[str], env: dict[str, str], log_path: Path,
                timeout: float = 60.0) -> Iterator[str]:
    """Run a web server `command` (listening on the `--bind`/`-b` address it names) until
    the block ends; yields its base URL once /health answers."""
    bind = command[(command.index("--bind") if "--bind" in command else command.index("-b")) + 1]
    url = f"http://{bind}"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log,
                                   stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + timeout
            while True:
                assert process.poll() is None, f"the web server exited; see {log_path}"
                try:
                    if requests.get(url + "/health", timeout=2).ok:
                        break
                except requests.RequestException:
                    pass
                assert time.monotonic() < deadline, f"the web server did not come up: {log_path}"
                time.sleep(0.2)
            yield url
        finally:
            process.terminate()
            process.wait(30)
