"""End-to-end job pipeline benchmark: HTTP + Celery + Redis + Postgres vs the bare engine.

    python benchmarks/bench_pipeline.py [--preset small] [--num-jobs 64] [--max-tokens 128]

In one run, on one random checkpoint (written with `workers.engine.make_model`):

1. offline: the engine alone (`build_engine`, same config as the worker) runs
   the workload, every request added at once: output tokens/s;
2. pipeline: gunicorn serving the API as `llmq web` does (gthread threads for requests,
   the stream server for event streams), one device-group worker process, real
   Postgres and Redis; `--num-jobs` clients each POST a job and read its SSE stream to
   the end, all concurrently: output tokens/s from the first POST to the last terminal
   event, and per-token delivery latency = SSE client receive time - the batcher's publish
   time (`ts` of the token event; same host, same clock). A job's tokens after its first
   go out at most once per `LLMQ_STREAM_INTERVAL_SECONDS` (the worker's setting, taken
   from the environment: 0 sends every step's tokens), so a token can also wait up to that
   interval before its event is published;
3. the offline engine again, each request added when its job was created in the served
   run (taken from the rows): what the admission ramp alone costs an engine with no
   serving around it, which splits the end-to-end ratio into the ramp's share and the
   serving's;
4. submissions/s: `--submit-jobs` POSTs from `--submit-threads` threads for a model no
   worker serves (the rows stay queued; only the API, Postgres and the broker are timed).

Rounds (`--rounds`) run 1 then 2; one more offline run follows the last round, and each
round's ratio is its end-to-end rate against the mean of the offline runs just before and
just after it (the ratio against the run before alone is printed too).

Uses the Postgres and Redis this machine runs (a throwaway database and key prefix,
removed at the end). Prints a Markdown table and, with --json, the raw figures.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import queue
import selectors
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import requests

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench_services import add_service_args, create_scratch, drop_scratch  # noqa: E402

from kernels.cpu import describe as describe_cpu  # noqa: E402
from tasks.protocol import groups_key  # noqa: E402
from tasks.redis_client import make_redis  # noqa: E402
from tasks.settings import Settings  # noqa: E402
from tests.pipeline_helpers import process_threads, worker_env  # noqa: E402
from workers.batcher import THREAD_NAME as BATCHER_THREAD  # noqa: E402

WORKER_CLASSES = {"stream": "webapp.stream_worker.StreamWorker", "gthread": "gthread",
                  "gevent": "gevent"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small", help="workers.engine.make_model preset")
    p.add_argument("--num-jobs", type=int, default=64, help="concurrent jobs (= SSE streams)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3,
                   help="offline run then pipeline run, this many times, and one more "
                        "offline run; the ratio is taken per round against the offline "
                        "runs on both sides (this machine's speed drifts between minutes)")
    p.add_argument("--prompt-words", type=int, default=16)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of the engine, offline and in the worker")
    p.add_argument("--submit-jobs", type=int, default=400)
    p.add_argument("--submit-threads", type=int, default=8)
    p.add_argument("--web-threads", type=int, default=128)
    p.add_argument("--worker-concurrency", type=int, default=None,
                   help="Celery task threads of the worker (default: the worker's own)")
    p.add_argument("--web-worker-class", default="stream",
                   choices=["stream", "gthread", "gevent"],
                   help="stream: `llmq web`'s worker (webapp/stream_worker.py); gthread: a "
                   "thread per stream")
    p.add_argument("--web-processes", type=int, default=2,
                   help="gunicorn workers (the API scales by processes)")
    add_service_args(p)
    return p.parse_args(argv)


def prompts(n: int, words: int) -> list[str]:
    vocab = "the quick brown fox jumps over a lazy dog while seven owls watch".split()
    return [" ".join(vocab[(i * 7 + j * 3) % len(vocab)] for j in range(words)) + f" {i}"
            for i in range(n)]


def load_offline_engine(model_dir: str, args: argparse.Namespace, settings: Settings) -> Any:
    import torch

    from tasks.params import SamplingParams
    from workers.engine.builder import build_engine
    from workers.engine.config import EngineConfig
    from workers.host_memory import freeze_startup_objects

    torch.set_num_threads(args.threads)
    config = EngineConfig(block_size=settings.block_size, max_num_seqs=settings.max_num_seqs,
                          max_num_batched_tokens=settings.max_num_batched_tokens)
    engine = build_engine(model_dir, kv_cache_bytes=settings.kv_cache_bytes,
                                    config=config)
    engine.add_request("warmup", "warm up", SamplingParams(max_tokens=4, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    # NOTE: this process is also the client that reads the event streams: with the
    # engine's objects out of the collector's sight, a full collection does not stall the
    # reader (and show up as delivery latency) for 150 ms; the worker does the same
    freeze_startup_objects()
    return engine


def offline_around(offline_runs: list[dict[str, Any]],
                   key: str = "tokens_per_s") -> list[float]:
    """The offline engine's rate around each served run, from the offline runs in the
    order they ran, one before each served run and one after the last: the mean of the
    runs on both sides of it. This machine's speed drifts from minute to minute
    (docs/benchmarks.md); a served run set against the offline run on one side alone
    carries that drift into its ratio, either way."""
    return [(before[key] + after[key]) / 2
            for before, after in zip(offline_runs, offline_runs[1:])]


def run_offline(engine: Any, args: argparse.Namespace,
                round_index: int | str) -> dict[str, Any]:
    from tasks.params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0)
    started, cpu_started = time.perf_counter(), time.process_time()
    for i, prompt in enumerate(prompts(args.num_jobs, args.prompt_words)):
        engine.add_request(f"round{round_index}-r{i}", prompt, params)
    steps: list[tuple[float, int, int]] = []  # (end time, tokens, samples finished)
    while engine.has_unfinished_requests():
        deltas = engine.step()
        steps.append((time.perf_counter(), sum(len(d.new_token_ids) for d in deltas),
                      sum(1 for d in deltas if d.finished)))
    elapsed = time.perf_counter() - started
    num_tokens = sum(n for _, n, _ in steps)
    # steady state: from the first step after every prompt is in to the last step before
    # the first sample ends
    first_full = next((i for i, (_, n, _) in enumerate(steps) if n == args.num_jobs), 0)
    last_full = next((i for i, (_, _, f) in enumerate(steps) if f), len(steps)) - 1
    steady = steps[first_full:last_full + 1]
    steady_rate = (sum(n for _, n, _ in steady[1:]) / (steady[-1][0] - steady[0][0])
                   if len(steady) > 2 else float("nan"))
    return {"tokens": num_tokens, "seconds": elapsed, "tokens_per_s": num_tokens / elapsed,
            "steady_tokens_per_s": steady_rate,
            "cpu_seconds": round(time.process_time() - cpu_started, 2)}


def run_offline_at(engine: Any, args: argparse.Namespace, round_index: int,
                   arrivals: list[float]) -> dict[str, Any]:
    """The offline engine fed the same requests at the times their jobs were created in a
    served run (`arrivals`: seconds after its first POST), stepping whenever it has work:
    what an engine with nothing around it makes of that admission ramp. Against the
    offline run (every request at once) it is the ramp's own cost; the served run
    against it is what the serving adds beyond the ramp."""
    from tasks.params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0)
    texts = prompts(len(arrivals), args.prompt_words)
    arrivals = sorted(arrivals)
    added = num_tokens = 0
    started = time.perf_counter()
    while added < len(arrivals) or engine.has_unfinished_requests():
        now = time.perf_counter() - started
        while added < len(arrivals) and arrivals[added] <= now:
            engine.add_request(f"round{round_index}-at-r{added}", texts[added], params)
            added += 1
        if engine.has_unfinished_requests():
            num_tokens += sum(len(d.new_token_ids) for d in engine.step())
        elif added < len(arrivals):
            time.sleep(max(0.0, arrivals[added] - now))
    elapsed = time.perf_counter() - started
    return {"tokens": num_tokens, "seconds": elapsed, "tokens_per_s": num_tokens / elapsed,
            "last_arrival_s": arrivals[-1] if arrivals else 0.0}


class Services:
    """A throwaway database, a gunicorn API and one worker process."""

    def __init__(self, args: argparse.Namespace, model_dir: str, workdir: Path) -> None:
        self.args = args
        self.scratch = create_scratch(args.postgres_url, args.redis_url)
        self.settings = Settings(
            database_url=self.scratch.database_url, redis_url=args.redis_url,
            redis_prefix=self.scratch.redis_prefix,
            models={"bench": model_dir, "idle": model_dir},
        )
        self.redis = make_redis(args.redis_url)
        env = worker_env(self.settings, OMP_NUM_THREADS=str(args.threads),
                         LLMQ_LOG_LEVEL="WARNING")
        self.port = _free_port()
        self.logs = [open(workdir / "web.log", "wb"), open(workdir / "worker.log", "wb")]
        self.web = subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "-k", WORKER_CLASSES[args.web_worker_class],
             "-w", str(args.web_processes), "--threads", str(args.web_threads),
             "--worker-connections", str(args.web_threads * 4),
             "-b", f"127.0.0.1:{self.port}", "webapp.wsgi:app"],
            cwd=REPO, env=env, stdout=self.logs[0], stderr=subprocess.STDOUT)
        self.worker = subprocess.Popen(
            [sys.executable, "-m", "workers.main", "--model-name", "bench", "--group-id",
             "bench-group", "--loglevel", "WARNING",
             *(["--concurrency", str(args.worker_concurrency)] if args.worker_concurrency
               else [])],
            cwd=REPO, env=env, stdout=self.logs[1], stderr=subprocess.STDOUT)
        self.base_url = f"http://127.0.0.1:{self.port}"
        try:
            self._wait_ready()
        except BaseException:
            self.close()  # a failed start must not leave servers or the database behind
            raise

    def _wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for proc in (self.web, self.worker):
                if proc.poll() is not None:
                    raise RuntimeError(f"a service exited with {proc.returncode}; see the logs")
            try:
                web_up = requests.get(self.base_url + "/v1/models", timeout=2).ok
            except requests.RequestException:
                web_up = False
            if web_up and self.redis.hget(groups_key(self.settings, "bench"), "bench-group"):
                return
            time.sleep(0.2)
        raise RuntimeError("the API or the worker did not come up in time")

    def close(self) -> None:
        for proc in (self.worker, self.web):
            proc.terminate()
        for proc in (self.worker, self.web):
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        for log in self.logs:
            log.close()
        drop_scratch(self.scratch)


def thread_cpu(pid: int, totals: dict[str, float] | None = None) -> dict[str, float]:
    """CPU seconds so far of each named thread of process `pid` and of its child processes
    (the worker's database process) (Linux; the worker names its threads,
    workers/thread_names.py), summed by name; {} where /proc is missing."""
    ticks = os.sysconf("SC_CLK_TCK")
    totals = {} if totals is None else totals
    children: list[int] = []
    for name, task, fields in process_threads(pid):
        try:
            children += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue  # the thread ended
        totals[name] = totals.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    for child in children:
        thread_cpu(child, totals)
    return totals


BATCHER_KEY = "worker's batcher thread"


def thread_waits(pid: int, name: str) -> float:
    """Seconds the threads of process `pid` named `name` have spent runnable but waiting
    for a core (Linux: /proc/<pid>/task/<tid>/schedstat's second field, nanoseconds); 0.0
    where it is missing. Beside the thread's CPU time it splits the wall time it did not
    run into waiting for a core (the service's other processes on the same cores) and
    asleep (for the GIL, for work, for I/O)."""
    total = 0
    for thread_name, task, _ in process_threads(pid):
        if thread_name != name:
            continue
        try:
            total += int((task / "schedstat").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # the thread ended, or no scheduler statistics here
    return total / 1e9


def cpu_snapshot(services: Services) -> dict[str, float]:
    """CPU seconds used so far by each part (postgres: every backend, ours or not)."""
    import psutil

    def tree(pid: int) -> float:
        proc = psutil.Process(pid)
        total = 0.0
        for p in [proc, *proc.children(recursive=True)]:
            try:
                times = p.cpu_times()
                total += times.user + times.system
            except psutil.NoSuchProcess:
                pass
        return total

    def named(name: str, must_contain: str = "") -> float:
        total = 0.0
        for p in psutil.process_iter(["name", "cmdline", "cpu_times"]):
            cmdline = " ".join(p.info["cmdline"] or [])
            if p.info["name"] == name and must_contain in cmdline and p.info["cpu_times"]:
                total += p.info["cpu_times"].user + p.info["cpu_times"].system
        return total

    redis_port = services.args.redis_url.rsplit(":", 1)[-1].split("/")[0]
    # the worker's batcher thread on its own: the engine's loop (workers/thread_names.py)
    batcher = thread_cpu(services.worker.pid).get(BATCHER_THREAD, 0.0)
    return {"worker": tree(services.worker.pid), BATCHER_KEY: batcher,
            "web": tree(services.web.pid),
            "client": sum(psutil.Process().cpu_times()[:2]),
            "redis": named("redis-server", ":" + redis_port),
            "postgres": named("postgres")}


def warm_up(services: Services, args: argparse.Namespace) -> None:
    """Every web process loads the model's tokenizer on its first request: warm them all
    (connections land on whichever process accepts first), and the worker's engine too."""
    warmup = SseReader(services.port)
    for _ in range(8 * args.web_processes):
        response = requests.post(services.base_url + "/v1/jobs", timeout=60, json={
            "model": "bench", "prompt": "warm up", "max_tokens": 2, "temperature": 0.0})
        warmup.open(response.json()["id"])
    while warmup.num_done < 8 * args.web_processes:
        warmup.poll(0.1)


def run_pipeline(services: Services, args: argparse.Namespace) -> dict[str, Any]:
    """POST every job from a thread pool and read all SSE streams on ONE select loop.

    NOTE: a single-threaded reader stamps each event the moment its bytes arrive; 64
    client threads fighting over one GIL would measure the client, not the pipeline.
    Events published before their stream's response headers arrived are replays, not
    live deliveries, and are left out of the latency figures.
    """
    body = {"model": "bench", "max_tokens": args.max_tokens, "ignore_eos": True,
            "temperature": 0.0}
    submitted: queue.Queue[str] = queue.Queue()

    local = threading.local()

    def submit(prompt: str) -> None:
        # NOTE: one kept-alive connection per client thread and no client library: a new
        # connection and `requests` per POST cost the client ~3 ms of CPU each, on the
        # core the web and Postgres share during the ramp (the client is not the service)
        conn = getattr(local, "conn", None)
        if conn is None:
            conn = local.conn = http.client.HTTPConnection("127.0.0.1", services.port,
                                                          timeout=60)
        conn.request("POST", "/v1/jobs", json.dumps({**body, "prompt": prompt}),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        payload = response.read()
        if response.status != 202:
            raise RuntimeError(f"POST /v1/jobs answered {response.status}: {payload[:200]!r}")
        submitted.put(json.loads(payload)["id"])

    reader = SseReader(services.port)
    cpu_before = cpu_snapshot(services)
    waits_before = thread_waits(services.worker.pid, BATCHER_THREAD)
    started, started_wall = time.perf_counter(), time.time()
    with ThreadPoolExecutor(max_workers=16) as pool:
        futures = [pool.submit(submit, p) for p in prompts(args.num_jobs, args.prompt_words)]
        while reader.num_done < args.num_jobs:
            while True:
                try:
                    reader.open(submitted.get_nowait())
                except queue.Empty:
                    break
            reader.poll(0.01)
            for future in futures:
                if future.done() and future.exception():
                    raise RuntimeError(f"a submission failed: {future.exception()!r}")
    elapsed = time.perf_counter() - started
    cpu = {k: v - cpu_before[k] for k, v in cpu_snapshot(services).items()}
    batcher_waits = thread_waits(services.worker.pid, BATCHER_THREAD) - waits_before
    if reader.errors:
        raise RuntimeError(f"{len(reader.errors)} jobs did not succeed: {reader.errors[0]}")
    latencies = sorted(reader.latencies)
    return {
        "tokens": reader.num_tokens, "seconds": elapsed, "started_wall": started_wall,
        "tokens_per_s": reader.num_tokens / elapsed,
        "steady_tokens_per_s": reader.steady_rate(),
        "latencies": reader.latencies,
        "latency_ms_p50": 1000 * _percentile(latencies, 0.50),
        "latency_ms_p90": 1000 * _percentile(latencies, 0.90),
        "latency_ms_p99": 1000 * _percentile(latencies, 0.99),
        "latency_ms_max": 1000 * (latencies[-1] if latencies else float("nan")),
        "num_token_events": len(latencies),
        "cpu_seconds": {k: round(v, 2) for k, v in cpu.items()},
        "batcher_waiting_for_a_core_s": round(batcher_waits, 2),
    }


class SseReader:
    """Many SSE streams (HTTP/1.0: no chunking, the server closes at the end) on one loop."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.selector = selectors.DefaultSelector()
        self.latencies: list[float] = []
        self.arrivals: list[tuple[float, int]] = []  # (receive time, tokens) per token event
        self.first_token_at: dict[str, float] = {}
        self.ended_at: dict[str, float] = {}
        self.num_tokens = 0
        self.num_done = 0
        self.errors: list[str] = []

    def open(self, job_id: str) -> None:
        sock = socket.create_connection(("127.0.0.1", self.port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(f"GET /v1/jobs/{job_id}/events HTTP/1.0\r\nHost: bench\r\n"
                     "Accept: text/event-stream\r\n\r\n".encode())
        sock.setblocking(False)
        state = {"job_id": job_id, "buffer": b"", "live_since": None}
        self.selector.register(sock, selectors.EVENT_READ, state)

    def poll(self, timeout: float) -> None:
        ready = self.selector.select(timeout)
        # NOTE: every ready socket had its bytes when select returned; stamping each one
        # only when this loop gets to it would add the client's own parsing of the
        # sockets before it (tens of microseconds each) to the pipeline's latency.
        received_at = time.time()
        for key, _ in ready:
            sock, state = cast(socket.socket, key.fileobj), key.data
            data = sock.recv(1 << 16)
            if not data:
                self.selector.unregister(sock)
                sock.close()
                self.num_done += 1
                if not state.get("ended"):
                    self.errors.append(f"job {state['job_id']}: stream closed early")
                continue
            state["buffer"] += data
            if state["live_since"] is None:
                head, sep, rest = state["buffer"].partition(b"\r\n\r\n")
                if not sep:
                    continue
                state["live_since"], state["buffer"] = received_at, rest
            *events, state["buffer"] = state["buffer"].split(b"\n\n")
            for raw in events:
                self._event(state, raw, received_at)

    def steady_rate(self) -> float:
        """Output tokens/s while every job was generating: from the last first token to
        the first terminal event (ramp-up and tail left out)."""
        if not self.first_token_at or not self.ended_at:
            return float("nan")
        start, end = max(self.first_token_at.values()), min(self.ended_at.values())
        within = [n for t, n in self.arrivals if start < t <= end]
        if end <= start or not within:  # the first job ended as the last one began
            return float("nan")
        return sum(within) / (end - start)

    def _event(self, state: dict[str, Any], raw: bytes, received_at: float) -> None:
        fields = dict(line.split(b": ", 1) for line in raw.split(b"\n")
                      if b": " in line and not line.startswith(b":"))
        kind = fields.get(b"event", b"").decode()
        if kind == "token":
            data = json.loads(fields[b"data"])
            num_tokens = len(data.get("token_ids", []))
            self.num_tokens += num_tokens
            self.arrivals.append((received_at, num_tokens))
            self.first_token_at.setdefault(state["job_id"], received_at)
            ts = data.get("ts")
            if ts is not None and ts >= state["live_since"]:
                self.latencies.append(received_at - ts)
        elif kind in ("done", "error", "cancelled"):
            state["ended"] = True
            self.ended_at[state["job_id"]] = received_at
            if kind != "done":
                self.errors.append(f"job {state['job_id']}: {kind} {fields.get(b'data')!r}")


def job_timings(services: Services, last: int, started_wall: float) -> dict[str, Any]:
    """Where the `last` jobs' time went, from their rows: queue wait, first token; and
    when each was created, in seconds after `started_wall` (the run's first POST)."""
    from sqlalchemy import select

    from tasks.db import create_db_engine, make_sessionmaker
    from tasks.models import Job

    engine = create_db_engine(services.settings.database_url)
    with make_sessionmaker(engine)() as session:
        rows = session.execute(
            select(Job.created_at, Job.started_at, Job.first_token_at, Job.finished_at)
            .where(Job.model == "bench", Job.status == "succeeded")
            .order_by(Job.created_at.desc()).limit(last)
        ).all()
    engine.dispose()
    waits = sorted((r.started_at - r.created_at).total_seconds() for r in rows)
    ttft = sorted((r.first_token_at - r.created_at).total_seconds() for r in rows)
    after_claim = sorted((r.first_token_at - r.started_at).total_seconds() for r in rows)
    first = min(r.created_at for r in rows)

    def span(column: str) -> float:  # ms from the first job's creation to the last `column`
        return 1000 * (max(getattr(r, column) for r in rows) - first).total_seconds()

    return {"created_offsets_s": sorted(r.created_at.timestamp() - started_wall
                                        for r in rows),
            "created_span_ms": span("created_at"), "claimed_span_ms": span("started_at"),
            "first_token_span_ms": span("first_token_at"),
            "queue_wait_ms_p50": 1000 * _percentile(waits, 0.5),
            "queue_wait_ms_max": 1000 * waits[-1],
            "ttft_ms_p50": 1000 * _percentile(ttft, 0.5), "ttft_ms_max": 1000 * ttft[-1],
            "claimed_to_first_token_ms_p50": 1000 * _percentile(after_claim, 0.5),
            "claimed_to_first_token_ms_max": 1000 * after_claim[-1]}


def run_submissions(services: Services, args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "idle", "prompt": "queued only", "max_tokens": 8}
    per_thread = args.submit_jobs // args.submit_threads
    session_local = threading.local()

    def submitter() -> None:
        session = getattr(session_local, "s", None) or requests.Session()
        session_local.s = session
        for _ in range(per_thread):
            session.post(services.base_url + "/v1/jobs", json=body, timeout=60).raise_for_status()

    threads = [threading.Thread(target=submitter) for _ in range(args.submit_threads)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    total = per_thread * args.submit_threads
    return {"jobs": total, "seconds": elapsed, "jobs_per_s": total / elapsed}


def _percentile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from workers.engine.make_model import make_model

    workdir = Path(tempfile.mkdtemp(prefix="llmq-bench-pipeline-"))
    model_dir = str(make_model(workdir / "model", "qwen3", args.preset))
    settings = Settings.from_env()  # the environment the worker also starts with
    engine = load_offline_engine(model_dir, args, settings)
    services = Services(args, model_dir, workdir)
    rounds: list[dict[str, Any]] = []
    try:
        warm_up(services, args)
        for index in range(args.rounds):
            offline = run_offline(engine, args, index)
            print(f"round {index + 1} offline: {json.dumps(offline)}", flush=True)
            pipeline = run_pipeline(services, args)
            pipeline.update(job_timings(services, last=args.num_jobs,
                                        started_wall=pipeline.pop("started_wall")))
            latencies = pipeline.pop("latencies")
            arrivals = pipeline.pop("created_offsets_s")
            print(f"round {index + 1} pipeline: {json.dumps(pipeline)}", flush=True)
            at_arrivals = run_offline_at(engine, args, index, arrivals)
            print(f"round {index + 1} offline at the served arrivals: "
                  f"{json.dumps(at_arrivals)}", flush=True)
            rounds.append({"offline": offline, "pipeline": pipeline, "latencies": latencies,
                           "offline_at_arrivals": at_arrivals})
        closing = run_offline(engine, args, "closing")
        print(f"offline after the last round: {json.dumps(closing)}", flush=True)
        submissions = run_submissions(services, args)
    finally:
        services.close()
    offline_runs = [r["offline"] for r in rounds] + [closing]
    for r, rate, steady_rate in zip(rounds, offline_around(offline_runs),
                                    offline_around(offline_runs, "steady_tokens_per_s")):
        served = r["pipeline"]
        r["offline_around_tokens_per_s"] = rate
        r["ratio"] = served["tokens_per_s"] / rate
        r["ratio_to_offline_before"] = served["tokens_per_s"] / r["offline"]["tokens_per_s"]
        r["steady_ratio"] = served["steady_tokens_per_s"] / steady_rate
        at_arrivals = r["offline_at_arrivals"]["tokens_per_s"]
        r["ramp_ratio"] = at_arrivals / rate
        r["beyond_ramp_ratio"] = served["tokens_per_s"] / at_arrivals
    latencies = sorted(x for r in rounds for x in r.pop("latencies"))
    ratios = [r["ratio"] for r in rounds]
    # a round where the first job ended before the last began has no steady state (nan)
    steady = [r["steady_ratio"] for r in rounds if r["steady_ratio"] == r["steady_ratio"]]
    load = os.getloadavg()[0]
    figures = {"args": vars(args), "rounds": rounds, "offline_closing": closing,
               "submissions": submissions,
               "median_ratio": statistics.median(ratios),
               "median_steady_ratio": statistics.median(steady) if steady else float("nan"),
               "median_ramp_ratio": statistics.median(r["ramp_ratio"] for r in rounds),
               "median_beyond_ramp_ratio": statistics.median(r["beyond_ramp_ratio"]
                                                             for r in rounds),
               "latency_ms": {f"p{q}": 1000 * _percentile(latencies, q / 100)
                              for q in (50, 90, 99)},
               "load_average_1m": load, "cpu_count": os.cpu_count()}
    per_round = " / ".join(f"{100 * r['ratio']:.0f}%" for r in rounds)
    per_round_ramp = " / ".join(
        f"{100 * r['ramp_ratio']:.0f}% ({r['offline_at_arrivals']['last_arrival_s']:.2f} s)"
        for r in rounds)
    per_round_beyond = " / ".join(f"{100 * r['beyond_ramp_ratio']:.0f}%" for r in rounds)
    per_round_steady = " / ".join(f"{100 * r['steady_ratio']:.0f}%" for r in rounds)
    before_only = [r["ratio_to_offline_before"] for r in rounds]
    per_round_before = " / ".join(f"{100 * x:.0f}%" for x in before_only)
    offline_rates = " / ".join(f"{r['tokens_per_s']:.0f}" for r in offline_runs)
    pipeline_rates = " / ".join(f"{r['pipeline']['tokens_per_s']:.0f}" for r in rounds)
    lat = figures["latency_ms"]
    p = rounds[-1]["pipeline"]
    cpu = ", ".join(f"{k} {v:.2f}" for k, v in p["cpu_seconds"].items())
    on_core = p["cpu_seconds"][BATCHER_KEY] / p["seconds"]
    waiting = p["batcher_waiting_for_a_core_s"] / p["seconds"]
    rows = [
        ("workload", f"{args.num_jobs} jobs x {args.max_tokens} tokens, `{args.preset}` qwen3, "
                     f"{args.threads} torch thread(s), {args.rounds} rounds"),
        ("offline engine, output tok/s (before each round, then after the last)",
         offline_rates),
        ("end to end (HTTP + Celery + Redis + Postgres + SSE), output tok/s", pipeline_rates),
        ("**end to end / offline**, against the mean of the offline runs before and after "
         "(per round; median)", f"{per_round}; **{100 * figures['median_ratio']:.1f}%**"),
        ("end to end / the offline run before it alone (per round; median)",
         f"{per_round_before}; {100 * statistics.median(before_only):.1f}%"),
        ("offline engine fed each request when its job was created in the round (the "
         "last one's creation, s after the first POST) / offline (before and after): the "
         "admission ramp's own cost (per round; median)",
         f"{per_round_ramp}; {100 * figures['median_ramp_ratio']:.1f}%"),
        ("end to end / that offline engine fed at the same times: what the serving costs "
         "beyond the ramp (per round; median)",
         f"{per_round_beyond}; {100 * figures['median_beyond_ramp_ratio']:.1f}%"),
        ("steady state (every job generating) / offline steady state (before and after)",
         f"{per_round_steady}; median {100 * figures['median_steady_ratio']:.1f}%"),
        (f"token delivery latency, publish -> SSE client ({len(latencies)} events)",
         f"p50 {lat['p50']:.2f} ms, p90 {lat['p90']:.2f} ms, p99 {lat['p99']:.2f} ms"),
        ("queue wait p50 / max; first token p50 / max; claimed to first token p50 / max "
         "(last round)",
         f"{p['queue_wait_ms_p50']:.0f} / {p['queue_wait_ms_max']:.0f} ms; "
         f"{p['ttft_ms_p50']:.0f} / {p['ttft_ms_max']:.0f} ms; "
         f"{p['claimed_to_first_token_ms_p50']:.0f} / "
         f"{p['claimed_to_first_token_ms_max']:.0f} ms"),
        (f"job submissions ({args.submit_threads} client threads)",
         f"{submissions['jobs_per_s']:.0f} jobs/s"),
        ("CPU seconds, last round", f"{cpu}; offline engine "
                                    f"{rounds[-1]['offline']['cpu_seconds']:.2f}"),
        ("the worker's batcher thread over the run's wall time (last round): on a core; "
         "runnable, waiting for one; the rest asleep (GIL, work, I/O)",
         f"{100 * on_core:.0f}%; {100 * waiting:.0f}%; {100 * (1 - on_core - waiting):.0f}%"),
        ("token events per output token, last round (stream interval "
         f"{settings.stream_interval_seconds * 1000:g} ms: a job's first token at once, "
         "then at most one event per interval)",
         f"{p['num_token_events'] / p['tokens']:.2f}"),
        ("machine", f"{describe_cpu()}; {os.cpu_count()} cores, 1-min load average "
                    f"{load:.1f} at the end"),
    ]
    print("\n| | |\n| --- | --- |\n" + "\n".join(f"| {k} | {v} |" for k, v in rows) + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
