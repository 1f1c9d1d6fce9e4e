"""`Engine`: requests in, per-step completion deltas out (continuous batching).

The worker's batcher thread owns one engine and calls, between steps, `add_request` /
`abort_request`, and in its loop `step()`. One step is schedule → execute → update →
detokenize. Not thread-safe: only the batcher thread touches it.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

from kvcache.kv_cache_manager import KVCacheManager
from tasks.params import ModelLimits, SamplingParams, check_token_ids
from workers.engine.config import EngineConfig, EngineStats, PromptTooLongError
from workers.engine.detokenizer import IncrementalDetokenizer
from workers.engine.errors import DeviceGroupError, StepInterrupted
from workers.engine.outputs import CompletionDelta
from workers.engine.scheduler import Scheduler
from workers.engine.sequence import Sequence, SequenceStatus
from workers.engine.step_io import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from kernels.native import StopFlag
    from workers.engine.kv_connector import KVConnector
    from workers.engine.structured import StructuredOutputManager

logger = logging.getLogger(__name__)

# how long an idle step waits for a grammar compile (nothing else could run)
IDLE_GRAMMAR_WAIT_SECONDS = 0.01

__all__ = ["Engine", "EngineConfig", "EngineStats", "PromptTooLongError"]


class Runner(Protocol):
    """What the engine needs of a model runner (`workers.engine.model_runner.ModelRunner`)."""

    @property
    def num_blocks(self) -> int: ...

    @property
    def block_size(self) -> int: ...

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


@dataclass(slots=True)
class _Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]  # one per sample, index order


class Engine:
    def __init__(
        self,
        runner: Runner,
        tokenizer: Any,
        eos_token_ids: list[int],
        max_model_len: int,
        config: EngineConfig | None = None,
        kv_connector: KVConnector | None = None,
    ) -> None:
        self.config = config or EngineConfig()
        if kv_connector is not None and not self.config.enable_prefix_caching:
            raise ValueError("KV tiers need prefix caching (block hashes name the blocks): "
                             "enable prefix caching or configure no KV tiers")
        self.kv_connector = kv_connector
        if runner.block_size != self.config.block_size:
            raise ValueError(
                f"runner block_size {runner.block_size} != config block_size "
                f"{self.config.block_size}: build the runner with the engine's block size"
            )
        self.runner = runner
        self.tokenizer = tokenizer
        self.eos_token_ids = list(eos_token_ids)
        self.max_model_len = max_model_len
        self.kv_manager = KVCacheManager(
            runner.num_blocks, runner.block_size, self.config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.kv_manager,
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_model_len=max_model_len,
            eos_token_ids=self.eos_token_ids,
            long_prefill_token_threshold=self.config.long_prefill_token_threshold,
            enable_prefix_caching=self.config.enable_prefix_caching,
            kv_connector=kv_connector,
            background_priority=self.config.background_priority,
        )
        self._requests: dict[str, _Request] = {}
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self._num_steps = 0
        self.num_failed_steps = 0  # model steps that raised
        # failed steps since the last one that succeeded: a device that fails every step
        # (the service's circuit breaker reads it)
        self.num_consecutive_failed_steps = 0
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        # structured outputs: built with the first constrained request
        self._structured: StructuredOutputManager | None = None
        # `set_step_yield`: a background-only step may stop between layers
        self.num_interrupted_steps = 0
        self._step_yield: Callable[[], bool] | None = None
        self._yield_before = 0  # a step may stop before layers 0 .. this - 1
        self._yield_armed = False  # this step may stop
        self._stop_flag: StopFlag | None = None  # read by the native decoder
        self._stopped_last_step = False

    def set_step_yield(self, should_yield: Callable[[], bool] | None,
                       before_layers: int | None = None) -> bool:
        """Let a step that runs background sequences only (`EngineConfig`'s
        background_priority band) stop before one of its first `before_layers` layers
        (default: any layer) when `should_yield()` says so (the service: a foreground
        job is waiting to be added). Its chunks then run again in the next step, which
        the caller builds with the new request in it, so a foreground request waits for
        a layer rather than for a whole batch step.

        What a stop throws away is at most one step of background work, and only a
        background-only step stops: one runs only while no foreground sequence does, so
        stops come at most once per foreground arrival into an idle foreground band,
        however busy that band gets. The step after a stopped one never stops, so steps
        always progress. Returns False when the runner cannot stop a step (tensor
        parallelism, a runner without a layer loop); then nothing changes.

        `step_stop_flag` (a `kernels.native.StopFlag`, once this returned True): the
        caller sets it whenever `should_yield()` turns True and clears it when that turns
        False (the service: the inbox, as it admits and hands over an interactive job).
        The native decoder, which runs a step's layers in one C call, reads it between
        layers without the GIL; left unset, a decoder step stops only before it starts."""
        setter = getattr(self.runner, "set_yield_check", None)
        if should_yield is None:
            self._step_yield = None
            if setter is not None:
                setter(None)
            return True
        from kernels.native import StopFlag

        stop_flag = self._stop_flag or StopFlag()
        num_layers = setter(self._should_stop, self._decoder_stop) if setter is not None else 0
        if num_layers <= 0:
            return False
        self._step_yield = should_yield
        self._yield_before = before_layers if before_layers is not None else num_layers
        self._stop_flag = stop_flag
        return True

    @property
    def step_stop_flag(self) -> StopFlag | None:
        """The flag the native decoder reads between layers (`set_step_yield`)."""
        return self._stop_flag

    def _should_stop(self, layer_index: int) -> bool:
        """The model asks before each layer (the batcher thread, inside the forward)."""
        should_yield = self._step_yield
        return (self._yield_armed and layer_index < self._yield_before
                and should_yield is not None and should_yield())

    def _decoder_stop(self) -> tuple[StopFlag, int] | None:
        """The flag and the layers before which the native decoder may stop this step."""
        if not self._yield_armed or self._stop_flag is None:
            return None
        return self._stop_flag, self._yield_before

    def _may_stop(self, scheduler_output: SchedulerOutput) -> bool:
        """Whether this step may stop between layers: background sequences only (a
        foreground one never loses work to another), and no KV loaded into it from a tier
        (run again, those blocks would load again)."""
        if (self._step_yield is None or scheduler_output.blocks_to_load
                or self._stopped_last_step):
            return False
        is_background = self.scheduler.bands.is_background
        seqs = self.scheduler.seqs
        return all(s.seq_id in seqs and is_background(seqs[s.seq_id])
                   for s in scheduler_output.scheduled)

    def close(self, timeout: float | None = 10.0) -> None:
        """Release what outlives a step: write queued KV blocks to the tiers and close them;
        stop a tensor-parallel runner's rank processes and the grammar compile thread."""
        if self._structured is not None:
            self._structured.close()
        if self.kv_connector is not None:
            self.kv_connector.close(timeout)
        shutdown = getattr(self.runner, "shutdown", None)
        if shutdown is not None:
            shutdown()

    # ---- sizes and load -------------------------------------------------------------

    @property
    def block_size(self) -> int:
        return self.kv_manager.block_size

    @property
    def num_blocks(self) -> int:
        return self.kv_manager.num_blocks

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def can_admit(self, num_prompt_tokens: int) -> bool:
        """Whether one more request of this prompt length would start running now."""
        if self.num_running + self.num_waiting >= self.config.max_num_seqs:
            return False
        needed = sum(
            self._num_blocks_for(seq.num_tokens + 1) for seq in self.scheduler.waiting
        ) + self._num_blocks_for(num_prompt_tokens + 1)
        return needed <= self.kv_manager.num_free_blocks

    def _num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            kv_cache_usage=self.kv_manager.usage,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=self.scheduler.prefix_queries_tokens,
            prefix_cache_hits=self.scheduler.prefix_hits_tokens,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            num_steps=self._num_steps,
            num_interrupted_steps=self.num_interrupted_steps,
        )

    # ---- requests -------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
    ) -> int:
        """Queue a request; returns its number of prompt tokens.

        Raises InvalidParamError (tasks.params) for parameters outside what the model and
        the sampler take (the same check the API runs: nothing admitted here can make a
        batched step raise), PromptTooLongError when prompt + max_tokens exceeds
        max_model_len, InvalidStructuredOutputsError (tasks.structured, a ValueError)
        for a JSON schema, regex or grammar the grammar backend cannot parse, and
        ValueError for an empty prompt, a request the KV cache can never hold, or a
        request id already in use. A constraint that parses but does not compile fails
        its request alone (an ERROR delta from a later step).
        """
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use; use a unique id")
        # NOTE: the context length is checked below, with the prompt (PromptTooLongError)
        params.check(ModelLimits(vocab_size=self._vocab_size(), max_model_len=None))
        prompt_token_ids = self.tokenize(prompt)
        num_prompt = len(prompt_token_ids)
        if num_prompt + params.max_tokens > self.max_model_len:
            raise PromptTooLongError(num_prompt, params.max_tokens, self.max_model_len)
        needed_blocks = self._num_blocks_for(num_prompt + params.max_tokens)
        if needed_blocks > self.num_blocks:
            raise ValueError(
                f"request needs up to {needed_blocks} KV blocks ({num_prompt} prompt tokens + "
                f"max_tokens {params.max_tokens}) but the cache has {self.num_blocks}; "
                "lower max_tokens or give the KV cache more memory (kv_cache_bytes)"
            )
        spec = params.structured_outputs
        if spec is not None:
            self.structured.check(spec)
        arrival = next(self._arrivals)
        sample_params = [_params_for_sample(params, index) for index in range(params.n)]
        seqs = [
            Sequence(
                seq_id=next(self._seq_ids),
                request_id=request_id,
                index=index,
                prompt_token_ids=prompt_token_ids,
                params=sample_params[index],
                priority=priority,
                arrival=arrival,
                detokenizer=IncrementalDetokenizer(
                    self.tokenizer, prompt_token_ids, params.stop, skip_special_tokens=True
                ),
            )
            for index in range(params.n)
        ]
        if spec is not None:
            self.structured.add(seqs, spec)
        self._requests[request_id] = _Request(request_id, prompt_token_ids, params, seqs)
        self.scheduler.add_seqs(seqs)
        self._prompt_tokens_total += num_prompt
        logger.debug("request %s: %d prompt tokens, n=%d", request_id, num_prompt, params.n)
        return num_prompt

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Prompt token ids: a string is encoded, a token-id list copied; both checked
        against the model's vocabulary (a tokenizer may know more tokens than the
        embedding has rows)."""
        token_ids = list(self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt)
        check_token_ids(token_ids, "prompt", self._vocab_size())
        if not token_ids:
            raise ValueError("prompt is empty: give at least one token")
        return token_ids

    @property
    def structured(self) -> StructuredOutputManager:
        """The structured-output manager (grammar compiles, bitmasks, matchers)."""
        if self._structured is None:
            from workers.engine.structured import StructuredOutputManager
            from workers.engine.structured.backend import XgrammarBackend

            vocab_size = self._vocab_size() or len(self.tokenizer)
            self._structured = StructuredOutputManager(
                XgrammarBackend(self.tokenizer, vocab_size, self.eos_token_ids))
        return self._structured

    def _vocab_size(self) -> int | None:
        """The model's vocabulary (embedding rows); None for runners that do not say
        (test doubles), whose token ids are then checked for sign only."""
        return getattr(self.runner, "vocab_size", None)

    def abort_request(self, request_id: str) -> list[CompletionDelta]:
        """Stop a request; one CANCELLED delta per unfinished sample ([] if unknown)."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return []
        unfinished = [seq for seq in request.seqs if not seq.is_finished]
        self.scheduler.finish_seqs(unfinished, SequenceStatus.FINISHED_ABORTED)
        logger.debug("request %s aborted", request_id)
        return [self._delta(seq, [], "", None) for seq in unfinished]

    # ---- one step -------------------------------------------------------------------

    def step(self) -> list[CompletionDelta]:
        """Run one batched model step; one delta per sample that produced tokens or ended."""
        if not self.scheduler.has_unfinished_seqs():
            return []
        structured = self._structured
        failed = self._fail_uncompiled_grammars() if structured is not None else []
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.scheduled:
            try:
                if structured is not None:
                    structured.fill_bitmask(scheduler_output, self.scheduler.seqs)
                self._yield_armed = self._may_stop(scheduler_output)
                self._stopped_last_step = False
                runner_output = self.runner.execute(scheduler_output)
            except StepInterrupted:
                self.scheduler.step_interrupted(scheduler_output)
                self.num_interrupted_steps += 1
                self._stopped_last_step = True
                return failed
            except DeviceGroupError:
                # NOTE: nothing to isolate; what the step was to write stays unfindable
                self.num_failed_steps += 1
                self.num_consecutive_failed_steps += 1
                self.kv_manager.discard_uncommitted()
                raise
            except Exception as exc:
                return failed + self._step_failed(scheduler_output, exc)
            finally:
                self._yield_armed = False
        else:
            if structured is not None and structured.num_pending:
                structured.wait_for_compiles(IDLE_GRAMMAR_WAIT_SECONDS)
            runner_output = ModelRunnerOutput(seq_ids=[], sampled_token_ids=[], logprobs=[])
        self.num_consecutive_failed_steps = 0
        sampled = self.scheduler.update_from_output(scheduler_output, runner_output)
        self._num_steps += 1
        self._generation_tokens_total += len(sampled)
        if structured is not None:
            # NOTE: only here, after a step that succeeded, do the matchers move
            sampled, failed_now = self._advance_grammars(structured, sampled)
            failed += failed_now
        deltas = failed + [self._process_token(seq) for seq in sampled]
        for seq in sampled:
            if seq.is_finished:
                self._retire_if_done(seq.request_id)
        return deltas

    def _step_failed(self, scheduler_output: SchedulerOutput,
                     exc: Exception) -> list[CompletionDelta]:
        """Isolate a step that raised: fail only the request that makes it fail (the
        scheduler finds it by running the step's sequences alone), never its companions.
        Returns the ERROR deltas of the culprits (none while the search goes on)."""
        self.num_failed_steps += 1
        self.num_consecutive_failed_steps += 1
        reason = f"the model step failed for this request: {type(exc).__name__}: {exc}"
        culprits = self.scheduler.step_failed(scheduler_output)
        if not culprits:
            logger.warning("model step failed (%s: %s); isolating its %d sequences",
                           type(exc).__name__, exc, len(scheduler_output.scheduled))
            return []
        deltas: list[CompletionDelta] = []
        for request_id in dict.fromkeys(seq.request_id for seq in culprits):
            if request_id in self._requests:
                logger.error("request %s failed a model step on its own: %s: %s", request_id,
                             type(exc).__name__, exc, exc_info=exc)
            deltas += self._fail_request(request_id, reason)
        return deltas

    def _fail_request(self, request_id: str, reason: str, *,
                      caused_by_request: bool = False) -> list[CompletionDelta]:
        """End a request alone with FINISHED_ERROR: one ERROR delta (carrying `reason`)
        per unfinished sample; [] when the request is gone already."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return []
        unfinished = [seq for seq in request.seqs if not seq.is_finished]
        self.scheduler.finish_seqs(unfinished, SequenceStatus.FINISHED_ERROR)
        deltas = []
        for seq in unfinished:
            delta = self._delta(seq, [], "", None)
            delta.error = reason
            delta.caused_by_request = caused_by_request
            deltas.append(delta)
        return deltas

    def _fail_uncompiled_grammars(self) -> list[CompletionDelta]:
        """Fail, each alone, the requests whose structured-output grammar did not compile."""
        assert self._structured is not None
        deltas: list[CompletionDelta] = []
        for seq in self._structured.take_failed():
            grammar = seq.grammar
            reason = grammar.error if grammar is not None else None
            logger.warning("request %s: its grammar did not compile: %s", seq.request_id,
                           reason)
            deltas += self._fail_request(seq.request_id, reason or "the grammar did not compile",
                                         caused_by_request=True)
        return deltas

    def _advance_grammars(
        self, structured: StructuredOutputManager, sampled: list[Sequence]
    ) -> tuple[list[Sequence], list[CompletionDelta]]:
        """Feed the step's tokens to the constrained sequences' matchers: a complete
        grammar ends its sequence with `stop`; a token the grammar refuses (a sampler bug)
        fails its request. (A grammar that can only end while min_tokens holds EOS back
        ends with `stop`: the sampler's structured path handles it.)
        Returns the sampled sequences still to report, and the ERROR deltas."""
        terminated, rejected = structured.advance(sampled)
        unfinished = [seq for seq in terminated if not seq.is_finished]
        if unfinished:
            self.scheduler.finish_seqs(unfinished, SequenceStatus.FINISHED_STOPPED)
        if not rejected:
            return sampled, []
        deltas: list[CompletionDelta] = []
        for seq in rejected:
            token_id = seq.output_token_ids[-1]
            logger.error("request %s: token %d is outside its grammar", seq.request_id,
                         token_id)
            deltas += self._fail_request(
                seq.request_id, f"the sampled token {token_id} is outside the request's "
                "structured_outputs grammar (is min_tokens masking the only allowed end?)")
        failed_ids = {seq.request_id for seq in rejected}
        return [seq for seq in sampled if seq.request_id not in failed_ids], deltas

    def _process_token(self, seq: Sequence) -> CompletionDelta:
        token_id = seq.output_token_ids[-1]
        detokenizer = seq.detokenizer
        assert detokenizer is not None
        text = ""
        # NOTE: a token that ended the sequence by rule (EOS, stop token id) stays in the
        # token ids but not in the text.
        stopped_by_token = seq.status == SequenceStatus.FINISHED_STOPPED
        if not stopped_by_token:
            text, matched_stop = detokenizer.add_tokens([token_id])
            if matched_stop is not None:
                seq.stop_reason = matched_stop
                if seq.is_finished:  # also hit a length limit: the stop string wins
                    seq.status = SequenceStatus.FINISHED_STOPPED
                else:
                    self.scheduler.finish_seqs([seq], SequenceStatus.FINISHED_STOPPED)
                return self._delta(seq, [token_id], text, seq.output_logprobs[-1])
        if seq.is_finished:
            text += detokenizer.flush()
        return self._delta(seq, [token_id], text, seq.output_logprobs[-1])

    def _delta(
        self, seq: Sequence, new_token_ids: list[int], text: str, logprobs: Any
    ) -> CompletionDelta:
        return CompletionDelta(
            request_id=seq.request_id,
            index=seq.index,
            new_token_ids=new_token_ids,
            text=text,
            logprobs=[logprobs] if seq.params.logprobs is not None and logprobs else None,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            stop_reason=seq.stop_reason,
        )

    def _retire_if_done(self, request_id: str) -> None:
        request = self._requests.get(request_id)
        if request is not None and all(seq.is_finished for seq in request.seqs):
            del self._requests[request_id]
            logger.debug("request %s finished", request_id)


def _params_for_sample(params: SamplingParams, index: int) -> SamplingParams:
    """Sample `index`'s params: samples 1.. of a seeded request get seeds of their own.

    The sampler draws a seeded sequence's numbers from (seed, output position) only, so
    samples sharing a seed would all be equal. Sample 0 keeps the request's seed: a seeded
    n=1 request and sample 0 of the same request with n>1 agree.
    """
    if index == 0 or params.seed is None:
        return params
    seed = (params.seed + index * 0x9E3779B97F4A7C15) % (1 << 63)
    return replace(params, seed=seed)
