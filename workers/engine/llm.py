"""`LLM`: offline batched generation in one process, the way vLLM users know it.

    from workers import LLM, SamplingParams
    llm = LLM("path/to/checkpoint")
    outputs = llm.generate(["Hello", "The river"], SamplingParams(max_tokens=32))
    print(outputs[0].text)

    # constrained decoding: a JSON schema (or regex=, choice=[...], grammar=, json_object=True)
    from workers import StructuredOutputs
    schema = {"type": "object", "properties": {"name": {"type": "string"}}}
    llm.generate(["Describe a person"], SamplingParams(
        max_tokens=64, structured_outputs=StructuredOutputs(json=schema)))

All prompts go into one engine at once; continuous batching runs them together.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from typing import Self

from tasks.params import SamplingParams
from workers.engine.builder import build_engine
from workers.engine.config import EngineConfig
from workers.engine.outputs import FinishReason
from workers.engine.step_io import TokenLogprobs

logger = logging.getLogger(__name__)

Prompt = str | list[int]


@dataclass(slots=True)
class CompletionOutput:
    index: int  # sample index
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    logprobs: list[TokenLogprobs] | None  # one per token when params.logprobs is set
    stop_reason: str | int | None = None
    error: str | None = None  # why, when finish_reason is ERROR


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None  # None when the prompt was given as token ids
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # one per sample, index order
    num_cached_tokens: int  # prompt tokens served from the prefix cache

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.outputs[0].finish_reason


class LLM:
    def __init__(
        self,
        model_dir: str,
        dtype: str = "auto",
        device: str = "cpu",
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        block_size: int = 16,
        kv_cache_bytes: int = 256 * 1024 * 1024,
        enable_prefix_caching: bool = True,
        max_model_len: int | None = None,
        long_prefill_token_threshold: int = 0,
        tensor_parallel_size: int = 1,
        kv_tiers: list[str] | None = None,
        kv_key_prefix: str = "llmq",
        kv_reuse_filter: bool = False,
    ) -> None:
        """`kv_tiers`: ordered KV tier URLs below the device cache (docs/kv-tiers.md), e.g.
        ["redis://127.0.0.1:6379/1?ttl_seconds=3600", "file:///tmp/kv?max_bytes=10000000000"];
        blocks are keyed under `kv_key_prefix`. Call `close()` to write what is queued.
        `dtype="auto"`: LLMQ_DTYPE if set, else bf16 on a CPU with native bf16, fp32 on other
        CPUs, the checkpoint's dtype on an accelerator."""
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size}: use 1 or more")
        config = EngineConfig(
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            long_prefill_token_threshold=long_prefill_token_threshold,
            enable_prefix_caching=enable_prefix_caching,
        )
        self.engine = build_engine(
            model_dir, dtype=dtype, device=device, kv_cache_bytes=kv_cache_bytes, config=config,
            kv_tiers=kv_tiers or (), kv_key_prefix=kv_key_prefix,
            kv_reuse_filter=kv_reuse_filter, tensor_parallel_size=tensor_parallel_size,
        )
        self._request_ids = itertools.count()

    def close(self) -> None:
        """Write the KV blocks still queued for the tiers and close them; stop the
        tensor-parallel rank processes (tensor_parallel_size > 1)."""
        self.engine.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | SequenceABC[Prompt],
        params: SamplingParams | SequenceABC[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt; outputs come back in the order of the prompts.

        `prompts` are strings or token-id lists (one prompt alone is accepted too);
        `params` is one SamplingParams for all, or one per prompt.
        """
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompt_list = list(prompts)  # type: ignore[arg-type]
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            param_list = [params] * len(prompt_list)
        else:
            param_list = list(params)
            if len(param_list) != len(prompt_list):
                raise ValueError(
                    f"got {len(param_list)} SamplingParams for {len(prompt_list)} prompts; "
                    "pass one for all or one per prompt"
                )

        outputs: dict[str, RequestOutput] = {}
        order: list[str] = []
        try:
            for prompt, sampling in zip(prompt_list, param_list):
                request_id = str(next(self._request_ids))
                prompt_token_ids = self.engine.tokenize(prompt)
                self.engine.add_request(request_id, prompt_token_ids, sampling)
                outputs[request_id] = RequestOutput(
                    request_id=request_id,
                    prompt=prompt if isinstance(prompt, str) else None,
                    prompt_token_ids=prompt_token_ids,
                    outputs=[
                        CompletionOutput(
                            i, "", [], None, [] if sampling.logprobs is not None else None
                        )
                        for i in range(sampling.n)
                    ],
                    num_cached_tokens=0,
                )
                order.append(request_id)
            while self.engine.has_unfinished_requests():
                for delta in self.engine.step():
                    request = outputs[delta.request_id]
                    out = request.outputs[delta.index]
                    out.token_ids.extend(delta.new_token_ids)
                    out.text += delta.text
                    if out.logprobs is not None and delta.logprobs:
                        out.logprobs.extend(delta.logprobs)
                    request.num_cached_tokens = delta.num_cached_tokens
                    if delta.finished:
                        out.finish_reason = delta.finish_reason
                        out.stop_reason = delta.stop_reason
                        out.error = delta.error
        except BaseException:
            for request_id in order:  # leave the engine clean for the next call
                self.engine.abort_request(request_id)
            raise
        return [outputs[request_id] for request_id in order]
