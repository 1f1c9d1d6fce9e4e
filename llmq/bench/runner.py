"""Dispatch: each request leaves at its arrival offset and runs on a pool of threads
whose size is `--max-concurrency` (so at most that many are in flight; the rest wait in
arrival order), as vLLM's semaphore does."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from llmq.bench.request_types import RequestFunc, RequestInput, RequestOutput

MAX_THREADS = 4096  # without --max-concurrency: one thread per request up to this


def run_requests(func: RequestFunc, inputs: list[RequestInput], offsets: list[float],
                 max_concurrency: int | None,
                 on_done: Callable[[], Any] | None = None) -> tuple[list[RequestOutput], float]:
    """Send `inputs[i]` at `offsets[i]` seconds from the start; return the outputs (in
    input order) and the duration in seconds, first dispatch to last completion."""
    if max_concurrency is not None and max_concurrency <= 0:
        raise ValueError(f"--max-concurrency must be greater than 0, got {max_concurrency}")
    workers = max(1, min(max_concurrency or len(inputs), MAX_THREADS))
    futures: list[Future[RequestOutput]] = []
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="llmq-bench") as pool:
        start = time.perf_counter()
        for offset, request in zip(offsets, inputs):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            future = pool.submit(func, request)
            if on_done is not None:
                future.add_done_callback(lambda _: on_done())
            futures.append(future)
        outputs = [future.result() for future in futures]
        duration = time.perf_counter() - start
    return outputs, duration
