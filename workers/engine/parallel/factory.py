"""Build the runner of a tensor-parallel device group from a device spec, after checking
that this host and this checkpoint can run it."""

from __future__ import annotations

import logging

from workers.engine.parallel.driver import TensorParallelRunner
from workers.engine.topology import build_topology, check_backend, check_model_dir

logger = logging.getLogger(__name__)


def make_tp_runner(
    model_dir: str,
    *,
    device: str,
    tp_size: int,
    device_indices: list[int] | None = None,
    dtype: str = "auto",
    block_size: int = 16,
    kv_cache_bytes: int = 256 << 20,
    max_num_batched_tokens: int = 8192,
    max_num_seqs: int = 256,
    timeout_seconds: float = 120.0,
) -> TensorParallelRunner:
    """A `TensorParallelRunner` over `tp_size` devices of kind `device` ("cpu", "cuda",
    "npu"); `device_indices` default to 0..tp_size-1. `kv_cache_bytes` is per device."""
    topology = build_topology(device, device_indices, tp_size)
    if len(topology.groups) != 1:
        raise ValueError(f"{len(topology.devices)} devices make {len(topology.groups)} groups "
                         f"of --tp {tp_size}; one engine runs one group")
    check_backend(topology)
    check_model_dir(model_dir, tp_size)
    group = topology.groups[0]
    return TensorParallelRunner(
        model_dir, group.device_names, dtype=dtype, dist_backend=group.kind.dist_backend,
        block_size=block_size, kv_cache_bytes=kv_cache_bytes,
        max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
        timeout_seconds=timeout_seconds,
    )
