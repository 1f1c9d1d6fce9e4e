"""What rank 0 and the other TP ranks say to each other over their pipes: plain data.

rank 0 -> rank r: `RunStep`, `ReadBlocks`, `WriteBlocks`, `Shutdown`.
rank r -> rank 0: `RankReady` once loaded, `BlocksRead` for a `ReadBlocks`, `RankFailed`
before a rank exits on an error.
"""

from __future__ import annotations

from dataclasses import dataclass

from workers.engine.parallel.step_delta import StepDelta


@dataclass(slots=True)
class RankSpec:
    """Everything a spawned rank process needs to load its shard and join the group."""

    model_dir: str
    dtype: str
    device: str  # torch device name of this rank, e.g. "cpu", "cuda:1", "npu:0"
    tp_size: int
    tp_rank: int
    dist_backend: str  # "gloo" | "nccl" | "hccl"
    init_method: str  # "tcp://127.0.0.1:<port>": rank 0 hosts the rendezvous store
    block_size: int
    kv_cache_bytes: int  # per rank (per device)
    max_num_batched_tokens: int
    max_num_seqs: int
    timeout_seconds: float  # a collective waiting longer than this fails
    log_level: int
    num_threads: int | None = None  # torch intra-op threads of the rank (CPU)


@dataclass(slots=True)
class RunStep:
    delta: StepDelta  # the step against what the rank holds (parallel/step_delta.py)
    blocks_to_load: list[tuple[int, bytes]]  # (block id, this rank's slab of the block)


@dataclass(slots=True)
class ReadBlocks:
    block_ids: list[int]


@dataclass(slots=True)
class WriteBlocks:
    items: list[tuple[int, bytes]]  # (block id, this rank's slab of the block)


@dataclass(slots=True)
class Shutdown:
    pass


@dataclass(slots=True)
class RankReady:
    tp_rank: int
    pid: int
    num_blocks: int
    bytes_per_block: int


@dataclass(slots=True)
class BlocksRead:
    blobs: list[bytes]  # this rank's slab of each block asked for, in order


@dataclass(slots=True)
class RankFailed:
    tp_rank: int
    reason: str
