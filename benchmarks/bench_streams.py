"""How many idle event streams one web process holds while its API stays responsive.

    python benchmarks/bench_streams.py [--steps 1000,2000,5000,8000] [--worker-class stream]

Starts one gunicorn web process as `llmq web` does (`--worker-class stream`, 4 request
threads by default; or `gthread`, a thread per stream, for comparison), a throwaway
database and key prefix, and no device group: the jobs stay queued, so their event
streams stay open and idle. Then opens raw SSE connections in steps and, at each step,
times `GET /health` (p50 / p99 over `--health-requests`), one job submission and one
poll, and reads the web worker's resident memory: memory per stream is the growth over
the process before any stream, divided by the streams. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import requests

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench_services import add_service_args, create_scratch, drop_scratch  # noqa: E402

from llmq.commands import web_command  # noqa: E402
from tasks.settings import Settings  # noqa: E402
from tests.pipeline_helpers import worker_env  # noqa: E402

BATCH = 250  # connections opened before their answers are read (inside the backlog)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", default="1000,2000,5000,8000",
                   help="open streams at which to measure (ascending)")
    p.add_argument("--worker-class", default="stream", choices=["stream", "gthread"])
    p.add_argument("--threads", type=int, default=4, help="request threads of the process")
    p.add_argument("--jobs", type=int, default=50, help="queued jobs the streams follow")
    p.add_argument("--health-requests", type=int, default=100)
    p.add_argument("--open-timeout", type=float, default=30.0,
                   help="seconds a stream may take to start before the step fails")
    add_service_args(p)
    return p.parse_args(argv)


class Web:
    """A throwaway database and one gunicorn web process (one worker)."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        from workers.engine.make_model import make_model

        model_dir = str(make_model(workdir / "model", "qwen3", "tiny"))
        self.scratch = create_scratch(args.postgres_url, args.redis_url)
        self.settings = Settings(database_url=self.scratch.database_url,
                                 redis_url=args.redis_url,
                                 redis_prefix=self.scratch.redis_prefix,
                                 models={"idle": model_dir})
        port = _free_port()
        if args.worker_class == "stream":
            command = web_command("127.0.0.1", port, 1, args.threads, 2.0)
            command.remove("--access-logfile")
            command.remove("-")
        else:
            command = [sys.executable, "-m", "gunicorn", "-k", "gthread", "-w", "1",
                       "--threads", str(args.threads), "--worker-connections", "20000",
                       "-b", f"127.0.0.1:{port}", "webapp.wsgi:app"]
        self.log = open(workdir / "web.log", "wb")
        self.process = subprocess.Popen(
            command, cwd=REPO, env=worker_env(self.settings, LLMQ_LOG_LEVEL="WARNING"),
            stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"gunicorn exited; see {workdir / 'web.log'}")
            try:
                if requests.get(self.url + "/health", timeout=2).ok:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("gunicorn did not come up")
            time.sleep(0.2)

    def worker_process(self) -> psutil.Process:
        """The gunicorn worker (the master's only child): the process holding the streams."""
        children = psutil.Process(self.process.pid).children()
        assert len(children) == 1, children
        return children[0]

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()
        drop_scratch(self.scratch)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def open_streams(url: str, job_ids: list[str], first: int, count: int,
                 timeout: float) -> list[socket.socket]:
    host, port = url.removeprefix("http://").split(":")
    socks: list[socket.socket] = []
    for start in range(first, first + count, BATCH):
        batch = []
        for i in range(start, min(start + BATCH, first + count)):
            sock = socket.create_connection((host, int(port)), timeout=timeout)
            sock.sendall(f"GET /v1/jobs/{job_ids[i % len(job_ids)]}/events HTTP/1.1\r\n"
                         "Host: b\r\nAccept: text/event-stream\r\n\r\n".encode())
            batch.append(sock)
        for sock in batch:
            data = b""
            while b"retry:" not in data:
                chunk = sock.recv(4096)
                if not chunk:
                    raise RuntimeError(f"a stream was closed before it started: {data!r}")
                data += chunk
        socks.extend(batch)
    return socks


def measure(web: Web, args: argparse.Namespace, num_streams: int,
            base_rss: int) -> dict[str, Any]:
    timings = []
    for _ in range(args.health_requests):
        started = time.perf_counter()
        requests.get(web.url + "/health", timeout=30).raise_for_status()
        timings.append((time.perf_counter() - started) * 1000)
    timings.sort()
    started = time.perf_counter()
    job = requests.post(web.url + "/v1/jobs", json={"model": "idle", "prompt": "one more",
                                                    "max_tokens": 4}, timeout=30)
    submit_ms = (time.perf_counter() - started) * 1000
    started = time.perf_counter()
    poll = requests.get(f"{web.url}/v1/jobs/{job.json()['id']}", timeout=30)
    poll_ms = (time.perf_counter() - started) * 1000
    assert job.status_code == 202 and poll.status_code == 200
    proc = web.worker_process()
    rss = proc.memory_info().rss
    return {"streams": num_streams, "health_ms_p50": statistics.median(timings),
            "health_ms_p99": timings[int(0.99 * (len(timings) - 1))],
            "submit_ms": submit_ms, "poll_ms": poll_ms, "rss_mb": rss / 2**20,
            "kb_per_stream": (rss - base_rss) / 1024 / num_streams if num_streams else 0.0,
            "threads": proc.num_threads()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    steps = [int(s) for s in args.steps.split(",")]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the server inherits it
    if hard < steps[-1] + 1000:
        raise SystemExit(f"the open-files limit {hard} is too low for {steps[-1]} streams")
    web = Web(args, Path(tempfile.mkdtemp(prefix="llmq-bench-streams-")))
    socks: list[socket.socket] = []
    rows: list[dict[str, Any]] = []
    try:
        jobs = [requests.post(web.url + "/v1/jobs", json={"model": "idle", "prompt": f"j{i}",
                                                          "max_tokens": 4}, timeout=30)
                .json()["id"] for i in range(args.jobs)]
        rows.append(measure(web, args, 0, 0))
        base_rss = web.worker_process().memory_info().rss
        for step in steps:
            started = time.monotonic()
            try:
                socks += open_streams(web.url, jobs, len(socks), step - len(socks),
                                      args.open_timeout)
            except (OSError, RuntimeError) as exc:
                print(f"{step} streams: could not open them ({exc}); stopping", flush=True)
                break
            opened_s = time.monotonic() - started
            row = measure(web, args, step, base_rss)
            row["open_s"] = opened_s
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        for sock in socks:
            sock.close()
        web.close()
    cpu = platform.processor() or "unknown CPU"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    print(f"\n{args.worker_class} worker, {args.threads} request threads, one process; "
          f"{cpu}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}\n")
    print("| open streams | /health p50 / p99 ms | submit ms | poll ms | worker RSS MB | "
          "KB per stream | threads |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['streams']} | {row['health_ms_p50']:.1f} / {row['health_ms_p99']:.1f} "
              f"| {row['submit_ms']:.0f} | {row['poll_ms']:.0f} | {row['rss_mb']:.0f} | "
              f"{row['kb_per_stream']:.1f} | {row['threads']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "cpu": cpu, "rows": rows},
                                              indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
