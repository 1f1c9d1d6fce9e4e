"""When each request is sent: a Poisson process, or gamma-distributed gaps.

As vLLM: the gap before each request is gamma(shape=burstiness, scale=1/(rate*burstiness))
(mean 1/rate; burstiness 1 is exponential, i.e. Poisson arrivals; < 1 burstier, > 1 more
even), and the cumulative offsets are rescaled so the last request goes out at exactly
num_requests / rate, which keeps throughput comparable across seeds.
"""

from __future__ import annotations

import math

import numpy as np


def arrival_offsets(num_requests: int, request_rate: float, burstiness: float,
                    rng: np.random.Generator) -> list[float]:
    """Seconds from the start of the run at which each request is dispatched."""
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be positive, got {burstiness}")
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be positive (or inf), got {request_rate}")
    if num_requests == 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * num_requests
    if math.isinf(burstiness):
        gaps = np.full(num_requests, 1.0 / request_rate)
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness),
                         size=num_requests)
    offsets = np.cumsum(gaps)
    if offsets[-1] > 0:
        offsets *= (num_requests / request_rate) / offsets[-1]
    return offsets.tolist()
