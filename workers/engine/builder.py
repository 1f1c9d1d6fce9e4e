"""`build_engine`: a Hugging Face checkpoint directory in, a ready `Engine` out.

Loads the weights and tokenizer, builds the runner (one device, or a tensor-parallel group
of rank processes), sets the context length, and attaches the KV tiers. torch and the
model code load here, not when `workers.engine.core` is imported.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as SequenceABC
from typing import Any

from workers.engine.config import EngineConfig
from workers.engine.core import Engine

logger = logging.getLogger(__name__)


def build_engine(
    model_dir: str,
    *,
    dtype: str = "auto",
    device: str = "cpu",
    kv_cache_bytes: int = 256 * 1024 * 1024,
    config: EngineConfig | None = None,
    kv_tiers: SequenceABC[str] = (),
    kv_key_prefix: str = "llmq",
    kv_reuse_filter: bool = False,
    tensor_parallel_size: int = 1,
    device_indices: list[int] | None = None,
    tp_timeout_seconds: float = 120.0,
) -> Engine:
    """Load a Hugging Face checkpoint directory and build its runner and engine.

    `kv_tiers`: ordered KV tier URLs (`Settings.kv_tiers`, docs/kv-tiers.md) under the
    Redis key prefix `kv_key_prefix`; `kv_reuse_filter` stores a block to the tiers
    only once two sequences ended holding it.

    `tensor_parallel_size > 1` splits the model over that many devices of kind
    `device` (`device_indices`, default 0..tp-1; logical ranks on CPU), with one
    spawned rank process per extra device (docs/device-groups.md); `kv_cache_bytes`
    is then per device. `Engine.close()` stops the rank processes.
    """
    from workers.engine.loader import load_checkpoint
    from workers.engine.model_runner import ModelRunner

    config = config or EngineConfig()
    runner: Any
    if tensor_parallel_size > 1:
        from workers.engine.parallel import make_tp_runner

        runner = make_tp_runner(
            model_dir, device=device, tp_size=tensor_parallel_size,
            device_indices=device_indices, dtype=dtype, block_size=config.block_size,
            kv_cache_bytes=kv_cache_bytes,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs, timeout_seconds=tp_timeout_seconds,
        )
        try:
            return _with_runner(runner, runner.loaded, config, kv_tiers, kv_key_prefix,
                                kv_reuse_filter, tensor_parallel_size)
        except BaseException:
            runner.shutdown()  # no rank process outlives a failed build
            raise
    checkpoint = load_checkpoint(model_dir, dtype=dtype, device=device)
    runner = ModelRunner(
        checkpoint,
        block_size=config.block_size,
        kv_cache_bytes=kv_cache_bytes,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs,
    )
    return _with_runner(runner, checkpoint, config, kv_tiers, kv_key_prefix, kv_reuse_filter,
                        tensor_parallel_size)


def _with_runner(runner: Any, checkpoint: Any, config: EngineConfig,
                 kv_tiers: SequenceABC[str], kv_key_prefix: str, kv_reuse_filter: bool,
                 tensor_parallel_size: int) -> Engine:
    """The engine around a built runner: context length, KV tiers."""
    max_model_len = checkpoint.max_model_len
    if config.max_model_len is not None:
        if config.max_model_len > checkpoint.max_model_len:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the model's context "
                f"length {checkpoint.max_model_len}; lower max_model_len"
            )
        max_model_len = config.max_model_len
    capacity = runner.num_blocks * config.block_size
    if max_model_len > capacity:
        # NOTE: a sequence longer than the whole KV cache could never be scheduled; such a
        # request would be accepted and then fail in the worker. Clamp, as vLLM does.
        if config.max_model_len is not None:
            raise ValueError(
                f"max_model_len {max_model_len} needs more KV cache than the device has "
                f"({runner.num_blocks} blocks of {config.block_size} tokens = {capacity} "
                "tokens): lower max_model_len or give the KV cache more memory "
                "(kv_cache_bytes / LLMQ_KV_CACHE_BYTES)")
        logger.warning("the KV cache holds %d tokens, fewer than the model's context length "
                       "%d: serving max_model_len %d (give the cache more memory to serve "
                       "the full context)", capacity, max_model_len, capacity)
        max_model_len = capacity
    connector = None
    if kv_tiers:
        from workers.engine.tier_connector import TierConnector

        # NOTE: a TP group's blob is its ranks' slabs concatenated (the runner gathers and
        # scatters them), keyed by the whole TP layout (tp_size, rank 0)
        connector = TierConnector.from_urls(
            kv_tiers, kv_key_prefix, runner, checkpoint.fingerprint,
            reuse_filter=kv_reuse_filter, tp_size=tensor_parallel_size)
    return Engine(runner, checkpoint.tokenizer, list(checkpoint.eos_token_ids), max_model_len,
                  config, kv_connector=connector)
