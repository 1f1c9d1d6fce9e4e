"""Start-up timings that pick between ways of doing the same work on this machine."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Collection, Hashable
from typing import TypeVar

K = TypeVar("K", bound=Hashable)


def alternated_medians(runs: dict[K, Callable[[], object]], rounds: int,
                       prepare: Callable[[K], object] | None = None,
                       warmed: Collection[K] = ()) -> dict[K, float]:
    """Per key, the median seconds of its run over `rounds` rounds. The runs take turns
    round by round, in a rotating order, so a neighbour's load falls on all of them; an
    extra first round warms every run up and is not counted (the keys in `warmed`, which
    the caller has just run, skip it). `prepare(key)`, untimed, before each run."""
    keys = list(runs)
    times: dict[K, list[float]] = {key: [] for key in keys}
    for round_ in range(rounds + 1):
        shift = round_ % len(keys)
        for key in keys[shift:] + keys[:shift]:
            if not round_ and key in warmed:
                continue
            if prepare is not None:
                prepare(key)
            start = time.perf_counter()
            runs[key]()
            if round_:
                times[key].append(time.perf_counter() - start)
    return {key: statistics.median(ts) for key, ts in times.items()}
