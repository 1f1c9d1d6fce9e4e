"""Start-up timings that pick between ways of doing the same work on this machine."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Collection, Hashable
from typing import TypeVar

K = TypeVar("K", bound=Hashable)


def alternated_medians(runs: dict[K, Callable[[], object]], rounds: int,
                       prepare: Callable[[K], object] | None = None,
                       warmed: Collection[K] = (), drop_slower: float | None = None,
                       settle_rounds: int = 3) -> dict[K, float]:
    """Per key, the median seconds of its run over `rounds` rounds. The runs take turns
    round by round, in a rotating order, so a neighbour's load falls on all of them; an
    extra first round warms every run up and is not counted (the keys in `warmed`, which
    the caller has just run, skip it). `prepare(key)`, untimed, before each run.

    With `drop_slower`, a run whose median after `settle_rounds` timed rounds is at least
    `drop_slower` times the fastest one's is timed no more (it cannot win; its median so
    far is its figure): a start-up timing then spends its rounds on the runs that decide."""
    keys = list(runs)
    times: dict[K, list[float]] = {key: [] for key in keys}
    active = keys
    for round_ in range(rounds + 1):
        if drop_slower is not None and round_ == settle_rounds + 1 and len(active) > 1:
            so_far = {key: statistics.median(times[key]) for key in active}
            fastest = min(so_far.values())
            active = [key for key in active if so_far[key] < drop_slower * fastest]
        shift = round_ % len(active)
        for key in active[shift:] + active[:shift]:
            if not round_ and key in warmed:
                continue
            if prepare is not None:
                prepare(key)
            start = time.perf_counter()
            runs[key]()
            if round_:
                times[key].append(time.perf_counter() - start)
    return {key: statistics.median(ts) for key, ts in times.items()}
