"""Batch API benchmark: a big batch beside an interactive client, and the batch's
throughput beside the offline engine.

    python benchmarks/bench_batch.py [--preset small] [--num-lines 2000] [--max-tokens 32]

In one run, on one random checkpoint (written with `workers.engine.make_model`):

1. offline: the engine alone (same config as the worker) runs the batch's requests, all
   added at once: output tokens/s;
2. idle: an interactive client sends streaming completions one after another to the
   served API (gunicorn + one worker, real Postgres and Redis) with nothing else running:
   time to first token (client side: from the POST to the first text chunk);
3. busy: the same client while a `--num-lines` batch runs on the same worker; its TTFT
   beside idle's, and the batch's output tokens/s (create to `completed`, seen by polling)
   beside the offline engine's. Also the served engine's tokens and milliseconds per step
   while the lines ran (from two of the worker's heartbeats) beside the offline
   engine's: whether the batch is slower for emptier steps or for slower ones.

The three run `--rounds` times in a row (the services stay up), then the offline engine
once more; each round's throughput ratio is the batch's rate against the mean of the
offline runs just before and just after it (the ratio against the run before alone is
printed too), its TTFT ratio within the round, and the summary gives their medians: on a
small shared machine the same code moves by a third from one run to the next.

Uses the Postgres and Redis this machine runs (a throwaway database and key prefix,
removed at the end). Prints a Markdown table and, with --json, the raw figures.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench_pipeline import (  # noqa: E402
    BATCHER_KEY,
    BATCHER_THREAD,
    Services,
    cpu_snapshot,
    load_offline_engine,
    offline_around,
    prompts,
    thread_cpu,
    thread_waits,
)
from bench_services import add_service_args  # noqa: E402

from tasks.settings import Settings  # noqa: E402

# how often the client polls a running batch (its end is seen this late at most)
POLL_SECONDS = 0.1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small", help="workers.engine.make_model preset")
    p.add_argument("--rounds", type=int, default=3,
                   help="offline, idle and busy runs, this many times; medians of the "
                        "per-round ratios")
    p.add_argument("--num-lines", type=int, default=2000, help="requests in the batch")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per batch line")
    p.add_argument("--prompt-words", type=int, default=24)
    p.add_argument("--interactive-tokens", type=int, default=16,
                   help="output tokens per interactive request")
    p.add_argument("--idle-requests", type=int, default=30,
                   help="interactive requests timed on the idle server")
    p.add_argument("--interactive-gap", type=float, default=0.25,
                   help="seconds between the interactive client's requests")
    p.add_argument("--threads", type=int, default=1, help="torch threads (engine, worker)")
    p.add_argument("--web-worker-class", default="stream", choices=["stream", "gthread"])
    p.add_argument("--web-processes", type=int, default=1)
    p.add_argument("--web-threads", type=int, default=16)
    p.add_argument("--worker-concurrency", type=int, default=0)
    add_service_args(p)
    return p.parse_args(argv)


def run_offline(engine: Any, args: argparse.Namespace, round_index: int | str) -> dict[str, Any]:
    from tasks.params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0)
    started, cpu_started = time.perf_counter(), time.thread_time()
    steps_before = engine.stats().num_steps
    for i, prompt in enumerate(prompts(args.num_lines, args.prompt_words)):
        engine.add_request(f"offline-{round_index}-{i}", prompt, params)
    num_tokens = 0
    while engine.has_unfinished_requests():
        num_tokens += sum(len(d.new_token_ids) for d in engine.step())
    elapsed, cpu = time.perf_counter() - started, time.thread_time() - cpu_started
    steps = max(1, engine.stats().num_steps - steps_before)
    return {"tokens": num_tokens, "seconds": elapsed, "tokens_per_s": num_tokens / elapsed,
            "cpu_seconds": cpu, "tokens_per_step": num_tokens / steps,
            "ms_per_step": 1000 * elapsed / steps, "cpu_ms_per_step": 1000 * cpu / steps}


def group_figures(services: Services) -> dict[str, Any]:
    """The worker's last heartbeat: its engine's step and token counters, and when they
    were read (`engine_stats_at`)."""
    from tasks.protocol import groups_key

    raw = services.redis.hget(groups_key(services.settings, "bench"), "bench-group")
    return json.loads(raw) if raw else {}


def step_figures(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """Tokens per step and milliseconds per step of the served engine between two
    heartbeats."""
    steps = after.get("num_steps", 0) - before.get("num_steps", 0)
    tokens = (after.get("generation_tokens_total", 0)
              - before.get("generation_tokens_total", 0))
    seconds = after.get("engine_stats_at", 0.0) - before.get("engine_stats_at", 0.0)
    if steps <= 0:
        return {"tokens_per_step": float("nan"), "ms_per_step": float("nan")}
    return {"tokens_per_step": tokens / steps, "ms_per_step": 1000 * seconds / steps}


def ttft(client: Any, args: argparse.Namespace, index: int) -> float:
    """Seconds from the request to its first text chunk (a streaming completion)."""
    started = time.perf_counter()
    stream = client.completions.create(
        model="bench", prompt=f"an interactive question number {index}",
        max_tokens=args.interactive_tokens, temperature=0.0, stream=True,
        extra_body={"ignore_eos": True})
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.perf_counter() - started
    assert first is not None, "no text came back"
    return first


def run_busy(client: Any, args: argparse.Namespace, services: Services,
             round_index: int) -> dict[str, Any]:
    """The batch, and the interactive client beside it until it completes; with the CPU
    seconds each thread of the worker spent meanwhile."""
    lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "bench", "prompt": prompt, "max_tokens": args.max_tokens,
                       "temperature": 0.0, "ignore_eos": True}}
             for i, prompt in enumerate(prompts(args.num_lines, args.prompt_words))]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    upload = client.files.create(file=("bench.jsonl", io.BytesIO(data)), purpose="batch")
    done = threading.Event()
    samples: list[tuple[float, float]] = []  # (sent, unix s; TTFT, s)

    def interactive() -> None:
        index = 0
        while not done.is_set():
            sent = time.time()
            samples.append((sent, ttft(client, args, 100_000 * round_index + 10_000 + index)))
            index += 1
            done.wait(args.interactive_gap)

    worker_pid = services.worker.pid
    cpu_before = thread_cpu(worker_pid)
    parts_before = cpu_snapshot(services)
    waits_before = thread_waits(worker_pid, BATCHER_THREAD)
    started, started_unix = time.perf_counter(), time.time()
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                  completion_window="24h")
    created = time.perf_counter()
    while batch.status == "validating":  # its lines become jobs off the request
        time.sleep(POLL_SECONDS)
        batch = client.batches.retrieve(batch.id)
    validated, validated_unix = time.perf_counter(), time.time()
    thread = threading.Thread(target=interactive, daemon=True)
    thread.start()
    seen = {}  # status -> seconds after create when a poll first saw it
    # NOTE: the step figures come from the first and the last heartbeat whose engine
    # counters were read while the lines ran (heartbeats are seconds apart; a stale one
    # would mix in the idle phase's one-token steps or the idle time after the batch)
    group_before: dict[str, Any] = {}
    group_after: dict[str, Any] = {}
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        time.sleep(POLL_SECONDS)
        batch = client.batches.retrieve(batch.id)
        seen.setdefault(batch.status, round(time.perf_counter() - started, 2))
        if batch.status == "in_progress":
            figures = group_figures(services)
            if figures.get("engine_stats_at", 0.0) >= validated_unix:
                group_before = group_before or figures
                group_after = figures
    elapsed = time.perf_counter() - started
    cpu_after = thread_cpu(worker_pid)
    parts = {name: round(cpu - parts_before[name], 2)
             for name, cpu in cpu_snapshot(services).items()}
    waits = thread_waits(worker_pid, BATCHER_THREAD) - waits_before
    done.set()
    thread.join(60)
    # a request counts as beside the batch if it was sent before the last line ended (the
    # client goes on until a poll sees the batch complete)
    lines_ended = batch_lines_ended(services, batch.id)
    beside = [first for sent, first in samples if lines_ended is None or sent < lines_ended]
    output = client.files.content(batch.output_file_id).text.splitlines() \
        if batch.output_file_id else []
    tokens = sum(json.loads(line)["response"]["body"]["usage"]["completion_tokens"]
                 for line in output)
    return {"status": batch.status, "completed": batch.request_counts.completed,
            "failed": batch.request_counts.failed, "tokens": tokens, "seconds": elapsed,
            "create_seconds": created - started, "validate_seconds": validated - started,
            "first_line_seconds": first_line_started(services, batch.id) - started_unix,
            "tokens_per_s": tokens / elapsed, "status_seen_at": seen,
            "worker_thread_cpu_seconds": {name: round(cpu - cpu_before.get(name, 0.0), 2)
                                          for name, cpu in cpu_after.items()
                                          if cpu - cpu_before.get(name, 0.0) >= 0.01},
            # every part of the stack on the same cores meanwhile, and how long the batcher
            # thread was runnable but waited for a core
            "cpu_seconds": parts, "batcher_waiting_for_a_core_s": round(waits, 2),
            "interactive_tokens": len(samples) * args.interactive_tokens,
            "lines_ended_unix": lines_ended,
            # the served engine's steps between two heartbeats while the lines ran
            **step_figures(group_before, group_after),
            # batch-only steps stopped between layers to start an interactive job
            "interrupted_steps": (group_after.get("num_interrupted_steps", 0)
                                  - group_before.get("num_interrupted_steps", 0)),
            "ttft": beside}


def _read(services: Services, read: Callable[[Any], Any]) -> Any:
    """`read(session)` on a session of the served database, after the run (its own engine,
    disposed at once)."""
    from tasks.db import create_db_engine, make_sessionmaker

    engine = create_db_engine(services.settings.database_url)
    try:
        with make_sessionmaker(engine)() as session:
            return read(session)
    finally:
        engine.dispose()


def first_line_started(services: Services, batch_id: str) -> float:
    """When (unix s, the worker's clock) the first line of `batch_id` was claimed: lines
    run while later ones are still validated."""
    from sqlalchemy import func, select

    from tasks.models import Job

    first = _read(services, lambda session: session.scalar(
        select(func.min(Job.started_at)).where(Job.batch_id == batch_id)))
    return first.timestamp() if first is not None else float("nan")


def batch_lines_ended(services: Services, batch_id: str) -> float | None:
    """When (unix s, the services' clock) `batch_id`'s last line ended: its row's
    `finalizing_at`."""
    from sqlalchemy import select

    from tasks.models import Batch

    ended = _read(services, lambda session: session.scalar(
        select(Batch.finalizing_at).where(Batch.id == batch_id)))
    return None if ended is None else ended.timestamp()


def interactive_phases(services: Services, after: float, before: float) -> dict[str, float]:
    """Medians (ms) of the interactive jobs created between `after` and `before` (unix s):
    queued to claimed, claimed to first token (the worker's clock, from the rows)."""
    from datetime import UTC, datetime

    from sqlalchemy import select

    from tasks.models import Job

    rows = _read(services, lambda session: session.execute(
        select(Job.created_at, Job.started_at, Job.first_token_at)
        .where(Job.batch_id.is_(None),
               Job.created_at >= datetime.fromtimestamp(after, UTC),
               Job.created_at < datetime.fromtimestamp(before, UTC))).all())
    claim = [(s - c).total_seconds() for c, s, _ in rows if s is not None]
    first = [(f - s).total_seconds() for _, s, f in rows if s is not None and f is not None]
    return {"claim_ms_p50": 1000 * statistics.median(claim) if claim else float("nan"),
            "first_token_ms_p50": 1000 * statistics.median(first) if first else float("nan")}


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def run_round(engine: Any, client: Any, args: argparse.Namespace, services: Services,
              round_index: int) -> dict[str, Any]:
    """One round: the offline engine, the idle client, then the batch beside the client."""
    offline = run_offline(engine, args, round_index)
    print(f"round {round_index + 1} offline: {json.dumps(offline)}", flush=True)
    idle_started = time.time()
    idle = [ttft(client, args, 100_000 * round_index + i) for i in range(args.idle_requests)]
    print(f"round {round_index + 1} idle TTFT p50 {1000 * statistics.median(idle):.0f} ms",
          flush=True)
    busy_started = time.time()
    busy = run_busy(client, args, services, round_index)
    phases = {"idle": interactive_phases(services, idle_started, busy_started),
              "busy": interactive_phases(services, busy_started,
                                         busy["lines_ended_unix"] or time.time())}
    busy_ttft = busy.pop("ttft")
    print(f"round {round_index + 1} busy: {json.dumps(busy)}", flush=True)
    idle_ms = {f"p{q}": 1000 * _pct(idle, q / 100) for q in (50, 99)}
    busy_ms = {f"p{q}": 1000 * _pct(busy_ttft, q / 100) for q in (50, 99)}
    return {"offline": offline, "busy": busy, "idle_ttft_ms": idle_ms,
            "busy_ttft_ms": busy_ms, "num_idle_requests": len(idle),
            "num_busy_requests": len(busy_ttft), "phases": phases,
            "ttft_ratio": busy_ms["p50"] / idle_ms["p50"]}


def round_row(index: int, r: dict[str, Any]) -> str:
    """One round as a Markdown table row."""
    idle_ms, busy_ms, phases = r["idle_ttft_ms"], r["busy_ttft_ms"], r["phases"]
    busy, offline = r["busy"], r["offline"]
    batcher = busy["worker_thread_cpu_seconds"].get(BATCHER_THREAD)
    cpu = "n/a" if batcher is None else (
        f"{100 * batcher / busy['seconds']:.0f}%, "
        f"{1000 * batcher / (busy['tokens'] + busy['interactive_tokens']):.3f} / "
        f"{1000 * offline['cpu_seconds'] / offline['tokens']:.3f} ms")
    return (f"| {index + 1} | {idle_ms['p50']:.0f} ({idle_ms['p99']:.0f}) / "
            f"{busy_ms['p50']:.0f} ({busy_ms['p99']:.0f}) ms | **{r['ttft_ratio']:.2f}x** | "
            f"{phases['idle']['claim_ms_p50']:.0f}, {phases['idle']['first_token_ms_p50']:.0f}"
            f" / {phases['busy']['claim_ms_p50']:.0f}, "
            f"{phases['busy']['first_token_ms_p50']:.0f} ms | "
            f"{busy['tokens_per_s']:.0f} / {r['offline_around_tokens_per_s']:.0f}: "
            f"**{100 * r['throughput_ratio']:.0f}%** | {busy['completed']} / {busy['failed']}"
            f" | {busy['first_line_seconds']:.2f} / {busy['validate_seconds']:.1f} s | {cpu} | "
            f"{busy['tokens_per_step']:.1f} / {offline['tokens_per_step']:.1f}; "
            f"{busy['ms_per_step']:.2f} / {offline['ms_per_step']:.2f} ms |")


def neighbours_line(index: int, busy: dict[str, Any]) -> str:
    """Where the CPU of the cores went while a round's batch ran: the batcher thread (and
    how long it waited, runnable, for a core), the rest of the worker, and every other
    part of the stack on the same cores."""
    cpu, seconds = busy["cpu_seconds"], busy["seconds"]
    rest = cpu["worker"] - cpu[BATCHER_KEY]
    return (f"round {index + 1}, CPU seconds over the batch's {seconds:.1f} s: batcher thread "
            f"{cpu[BATCHER_KEY]:.2f} (runnable but waiting for a core "
            f"{busy['batcher_waiting_for_a_core_s']:.2f}), the worker's other threads and "
            f"its database process {rest:.2f}, web {cpu['web']:.2f}, Postgres "
            f"{cpu['postgres']:.2f}, Redis {cpu['redis']:.2f}, this client {cpu['client']:.2f}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import openai

    from workers.engine.make_model import make_model

    workdir = Path(tempfile.mkdtemp(prefix="llmq-bench-batch-"))
    model_dir = str(make_model(workdir / "model", "qwen3", args.preset))
    engine = load_offline_engine(model_dir, args, Settings.from_env())
    services = Services(args, model_dir, workdir)
    try:
        client = openai.OpenAI(base_url=services.base_url + "/v1", api_key="unused",
                               max_retries=0, timeout=600)
        ttft(client, args, -1)  # warm up
        rounds = [run_round(engine, client, args, services, i) for i in range(args.rounds)]
        closing = run_offline(engine, args, "closing")
        print(f"offline after the last round: {json.dumps(closing)}", flush=True)
    finally:
        services.close()
    offline_runs = [r["offline"] for r in rounds] + [closing]
    for r, rate in zip(rounds, offline_around(offline_runs)):
        r["offline_around_tokens_per_s"] = rate
        r["throughput_ratio"] = r["busy"]["tokens_per_s"] / rate
        r["throughput_ratio_to_offline_before"] = (r["busy"]["tokens_per_s"]
                                                   / r["offline"]["tokens_per_s"])
    figures = {"args": vars(args), "rounds": rounds, "offline_closing": closing,
               "cpu": _cpu_model(),
               "cpu_count": os.cpu_count(), "load_average_1m": os.getloadavg()[0]}
    ttft_ratios = [r["ttft_ratio"] for r in rounds]
    throughput_ratios = [r["throughput_ratio"] for r in rounds]
    print(f"\n{args.num_lines} lines x {args.max_tokens} tokens, `{args.preset}` qwen3, "
          f"{args.threads} torch thread(s); interactive: {args.interactive_tokens}-token "
          f"streaming completions, {args.interactive_gap} s apart; {figures['cpu']}, "
          f"{os.cpu_count()} cores, 1-min load average {figures['load_average_1m']:.1f} at "
          "the end\n")
    print("| round | interactive TTFT p50 (p99), idle / beside the batch | busy / idle | "
          "queued to claimed, claimed to first token (p50; idle / busy) | batch tok/s / "
          "offline engine (mean of the runs before and after) | lines completed / failed | "
          "first line claimed / all validated | batcher: share of wall time, CPU per output "
          "token / offline engine's | steps while the lines ran: tokens per step, time per "
          "step / offline engine's |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for i, r in enumerate(rounds):
        print(round_row(i, r))
    print(f"\n**Medians over {len(rounds)} round(s): interactive TTFT p50 "
          f"{statistics.median(ttft_ratios):.2f}x idle** (target <= 1.5x; rounds "
          f"{', '.join(f'{x:.2f}x' for x in ttft_ratios)}), **batch throughput "
          f"{100 * statistics.median(throughput_ratios):.0f}% of the offline engine** "
          f"(target >= 80%; rounds {', '.join(f'{100 * x:.0f}%' for x in throughput_ratios)})"
          "\n")
    before_only = [r["throughput_ratio_to_offline_before"] for r in rounds]
    print("offline engine, output tok/s, before each round then after the last: "
          + " / ".join(f"{run['tokens_per_s']:.0f}" for run in offline_runs)
          + "; the batch against the offline run before it alone: "
          + ", ".join(f"{100 * x:.0f}%" for x in before_only)
          + f" (median {100 * statistics.median(before_only):.0f}%)\n")
    for i, r in enumerate(rounds):
        print(neighbours_line(i, r["busy"]))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0

if __name__ == "__main__":
    sys.exit(main())
