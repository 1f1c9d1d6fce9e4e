"""`ModelRunner`: owns the device, the model and the paged KV cache, and turns each
`SchedulerOutput` into ONE forward pass over all scheduled tokens.

Prompt chunks and decodes run together, flattened in scheduled order. Logits are computed
only for the last token of each sequence that samples this step.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch

from kernels import linear as dense
from kernels import native
from kernels.attention import build_attention_metadata
from kernels.timing import alternated_medians
from workers.engine import huge_pages
from workers.engine.loader import LoadedCheckpoint
from workers.engine.models.layers import (
    LinearBase,
    ParallelLMHead,
    drop_unused_plain_weights,
    pack_panels,
    prepack_linears,
    probe_panels,
    probe_weights,
    use_native_kernel,
)
from workers.engine.startup_timings import StartupTimings, TimingsCache
from workers.engine.step_io import ModelRunnerOutput, ScheduledSequence, SchedulerOutput

if TYPE_CHECKING:
    from workers.engine.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

LINEAR_PATH_ENV = "LLMQ_LINEAR_PATH"
LINEAR_PATHS = ("auto", "prepacked", "reference", "split", "native")
# the rows the native kernel takes when `native` is asked for by name
NATIVE_ROWS = 4
# a decode step slower than this at start-up (a large model) is timed in SLOW_STEP_ROUNDS
# rounds when the native decoder is weighed
SLOW_STEP_SECONDS = 0.25
SLOW_STEP_ROUNDS = 2
# whole decode steps of these many rows are weighed too, past the linear probe's row counts:
# where a step's Python between the calls is most of it (the `small` preset in bf16, 64
# rows: 3.36 -> 2.28 ms on a Xeon with AMX), the decoder wins beyond 16 rows
DECODER_PROBE_ROWS = (32, 64)
# bf16 weights on a CPU without bf16 dot products get fp32 prepacked copies for the calls
# of many rows only while those copies take at most this share of the memory available
WIDENED_COPIES_MEMORY_SHARE = 0.5


class ModelRunner:
    """Runs one model on one device with a KV cache carved from a byte budget.

    The cache is ONE tensor `[num_blocks, 2, num_layers, block_size, num_kv_heads,
    head_dim]`: block-major, so a block's K and V of every layer is one contiguous slab
    that the KV tier moves as one blob (`read_blocks` / `write_blocks`).
    """

    def __init__(
        self,
        loaded: LoadedCheckpoint,
        block_size: int = 16,
        kv_cache_bytes: int = 256 << 20,
        max_num_batched_tokens: int = 8192,
        max_num_seqs: int = 256,
        linear_path: str | None = None,
    ) -> None:
        """`linear_path` (CPU): `prepacked` swaps each projection's weight for oneDNN's
        prepacked copy (kernels/linear.py; the plain copy is freed, the model can no longer
        move); `reference` keeps torch's `linear`; `split` keeps both and gives the calls
        of few rows to torch's `linear` (twice the projection memory); `native` gives
        calls of up to `NATIVE_ROWS` rows to our kernel on the plain weight and larger
        ones to the prepacked copy (twice the memory too); `auto` times the paths on the
        model's own shapes at start-up and takes what wins at each probed row count
        (`kernels.linear.choose_plan`); None: `LLMQ_LINEAR_PATH` (default `auto`).
        `self.linear_path` says which path runs."""
        self.loaded = loaded
        # every model of the registry is one (LoadedCheckpoint types it as any nn.Module)
        self.model = cast("LlamaForCausalLM", loaded.model)
        config = loaded.config
        self.device = next(self.model.parameters()).device
        self.dtype = config.dtype
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        # NOTE: a TP rank holds its shard of the KV heads; every rank has the same number
        # of blocks (same budget, same shard size), so block ids mean the same everywhere.
        num_kv_heads = config.num_kv_heads // loaded.tp_size
        self._block_shape = (2, config.num_layers, block_size, num_kv_heads, config.head_dim)
        elem = torch.empty((), dtype=self.dtype).element_size()
        self._bytes_per_block = elem * 2 * config.num_layers * block_size * (
            num_kv_heads * config.head_dim)
        num_blocks = kv_cache_bytes // self._bytes_per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_bytes={kv_cache_bytes} holds no KV block of "
                f"{self._bytes_per_block} bytes; raise the KV cache budget"
            )
        shape = (num_blocks, *self._block_shape)
        # NOTE: on the CPU in huge pages where the kernel gives them (workers/engine/
        # huge_pages.py): the decode attention streams each sequence's blocks
        self.kv_cache = (huge_pages.zeros(shape, self.dtype) if self.device.type == "cpu"
                         else torch.zeros(shape, dtype=self.dtype, device=self.device))
        self._sample: Callable | None = None
        # "prepacked" (oneDNN), "reference" (torch's linear), "split" (torch's linear up
        # to `plain_rows` rows, oneDNN above) or "native" (our kernel up to `skinny_rows`
        # rows, then as the plan says); per batch size, per path, the seconds measured at
        # start-up, when they were
        self.linear_path = "reference"
        self.plain_rows: int | None = None
        self.skinny_rows = 0
        self.linear_probe: dict[int, dict[str, float]] = {}
        self.huge_page_bytes = 0  # weights moved into huge pages (CPU)
        self.panel_weights = 0  # fp32 weights packed in panels for the native kernel
        # bf16 weights without bf16 dot products: fp32 prepacked copies may be made for
        # the calls of many rows (`widened_copies_fit`); how many were
        # (the ranks of a CPU tensor-parallel group share the host's memory and decide
        # at once, each after its own load: each takes its part of the share)
        self.widen = self.device.type == "cpu" and widened_copies_fit(
            self.model, ranks_on_host=loaded.tp_size)
        self.widened_weights = 0
        # per prefetch distance of the native kernel's one-row stream (bytes), the seconds
        # of a one-row pass timed at start-up, when they were (the fastest is kept)
        self.row_prefetch_probe: dict[int, float] = {}
        # the same for one-row calls on fp32 panels, per choice (`native.NEXT_PANEL` or
        # bytes ahead; the fastest is kept)
        self.panel_prefetch_probe: dict[int, float] = {}
        # then per number of panels such a call reads side by side (the fastest is kept)
        self.panel_streams_probe: dict[int, float] = {}
        # per number of bf16 weight rows a one-row call reads side by side on an AVX2
        # build, the seconds of a one-row pass (the fastest is kept)
        self.row_streams_probe: dict[int, float] = {}
        # where the start-up timings are kept (`LLMQ_TIMINGS_CACHE`; None: not kept), and
        # the timings an earlier start of this model on this machine stored there
        self.timings_cache: TimingsCache | None = None
        cached: StartupTimings | None = None
        if self.device.type == "cpu":
            path = linear_path_setting() if linear_path is None else check_linear_path(
                linear_path)
            # the projection weights the linear paths are timed on (and the timings keyed by)
            weights = probe_weights(self.model) if path == "auto" else []
            if path == "auto":
                self.timings_cache = self._timings_cache(weights)
                cached = self.timings_cache.load() if self.timings_cache else None
                if cached is not None:
                    logger.info("start-up timings read from %s (an earlier start of this "
                                "model on this machine; LLMQ_TIMINGS_CACHE=off times again)",
                                cast(TimingsCache, self.timings_cache).path)  # cached came from it
            plan = (self._probe_linear_path(weights, cached) if path == "auto"
                    else fixed_plan(path))
            self._apply_linear_plan(plan)
            # before the native decoder keeps the weights' addresses
            self.huge_page_bytes = huge_pages.move_to_huge_pages(self.model)
            # (the panels have their own prefetch: fp32 then leaves the one-row bodies)
            if path == "auto" and native.row_prefetch_tunable() and not self.panel_weights:
                self._choose_row_prefetch(cached)
            if path == "auto" and native.row_streams_tunable():
                self._choose_row_streams(cached)
            if path == "auto" and self.panel_weights:
                self._choose_panel_row_prefetch(cached)
                self._choose_panel_row_streams(cached)
        from kernels import dispatch

        self.step_kernels = "reference"
        # prompt chunks this short are attended to as decode rows (see
        # build_attention_metadata): with the native kernels, one call per layer
        self.chunks_as_decodes = 0
        if self.device.type == "cpu":
            if step_kernels_setting() == "native" and native.register():
                self.step_kernels = "native"
                self.chunks_as_decodes = native.CHUNK_AS_DECODES_TOKENS
            else:
                native.unregister()
        # decode steps of at most this many rows run every layer as one native call
        self.decoder_rows = 0
        # per row count, the seconds of a decode step on the plan's paths ("plan") and
        # with the native decoder ("decoder"), when the start-up timing weighed the two
        self.decoder_probe: dict[int, dict[str, float]] = {}
        use_decoder = getattr(self.model, "use_native_decoder", None)
        if self.step_kernels == "native" and use_decoder is not None:
            if self.skinny_rows:
                self.decoder_rows = use_decoder(self.skinny_rows)
            if self.linear_probe and self.linear_path != "prepacked" and native.available():
                self._weigh_native_decoder(use_decoder,
                                           timed=None if cached is None else cached.decoder_probe)
            if self.decoder_rows:
                logger.info("decode steps of up to %d rows: every layer in one native call",
                            self.decoder_rows)
        if self.timings_cache is not None and cached is None and self.linear_probe:
            self.timings_cache.store(StartupTimings(
                self.linear_probe, self.row_prefetch_probe, self.decoder_probe,
                self.panel_prefetch_probe, self.panel_streams_probe, self.row_streams_probe))
        dispatch.log_choices(self.device.type)
        logger.info("KV cache: %d blocks of %d tokens (%d bytes each) on %s", num_blocks,
                    block_size, self._bytes_per_block, self.device)

    def _timings_cache(self, weights: list[torch.Tensor]) -> TimingsCache | None:
        """Where this model's start-up timings on this machine are kept: keyed by all that
        decides what they find (workers/engine/startup_timings.py adds the CPU, threads,
        versions and code); `weights`: those the linear paths are timed on."""
        return TimingsCache.configured(
            config=repr(self.loaded.config), tp=f"{self.loaded.tp_rank}/{self.loaded.tp_size}",
            probe_shapes=[(tuple(w.shape), str(w.dtype)) for w in weights],
            block_size=self.block_size,
            # the decode steps weighed stop at this many rows
            max_rows=min(self.max_num_seqs, self.num_blocks, max(DECODER_PROBE_ROWS)),
            widen=self.widen, step_kernels=step_kernels_setting(),
            huge_pages=huge_pages.available(), native=native.isa())

    def _probe_linear_path(self, weights: list[torch.Tensor],
                           cached: StartupTimings | None = None) -> dense.LinearPlan:
        """Time the paths (torch's linear, oneDNN prepacked, the native kernel) on
        `weights` (`probe_weights`: the layers' projections up to `PROBE_MAX_BYTES`, and
        the LM head) at a few row counts, and plan by what wins where
        (`dense.choose_plan`). With `cached`, an earlier start's figures instead."""
        if not weights:
            return dense.LinearPlan("reference")
        started = time.perf_counter()
        if cached is not None and cached.linear_probe:
            self.linear_probe = times = cached.linear_probe
            how = "read from the start-up timings"
        else:
            self.linear_probe = times = dense.time_paths(weights, widen=self.widen)
            how = f"timed in {time.perf_counter() - started:.1f} s"
        plan = dense.choose_plan(times)
        logger.info("linear paths on %s, %s, %d threads, %d weights, %s (ms per pass): %s",
                    self.device, self.dtype, torch.get_num_threads(), len(weights), how,
                    dense.describe_times(times))
        return plan

    def _choose_row_prefetch(self, cached: StartupTimings | None = None) -> None:
        """Time the native kernel's one-row pass over the model's weights (where they now
        live: huge pages change how far ahead a prefetch pays) at each prefetch distance,
        and keep the fastest for the process. Zen 4: no software prefetch or 2 KiB
        ahead read 20% faster on one thread than the 16 KiB a Xeon with AMX wants.
        With `cached`, an earlier start's figures instead."""
        def measure() -> dict[int, float]:
            weights = probe_weights(self.model, beside_packed=True)
            if not weights or not all(native.supports(w) for w in weights):
                return {}
            return native.time_row_prefetch(weights)

        self.row_prefetch_probe = _keep_fastest(
            None if cached is None else cached.row_prefetch_probe, measure,
            native.set_row_prefetch, "with the native kernel prefetching N bytes ahead")

    def _choose_row_streams(self, cached: StartupTimings | None = None) -> None:
        """Time one-row passes over the model's bf16 weights (where they now live) reading
        1, 2 or 3 weight rows side by side (`native.ROW_STREAMS_CHOICES`; the AVX2 bf16
        body) and keep the fastest for the process. Zen 3: docs/benchmarks.md. Nothing
        to time where the weights are not bf16. With `cached`, an earlier start's
        figures instead."""
        def measure() -> dict[int, float]:
            weights = [w for w in probe_weights(self.model, beside_packed=True)
                       if w.dtype == torch.bfloat16 and native.supports(w)]
            return native.time_row_streams(weights) if weights else {}

        self.row_streams_probe = _keep_fastest(
            None if cached is None else cached.row_streams_probe, measure,
            native.set_row_streams, "on bf16 weights reading N weight rows at once")

    @property
    def row_streams(self) -> int | None:
        """How many bf16 weight rows one-row calls read at once, as the start-up timing
        kept (None: nothing was timed; one)."""
        return _fastest(self.row_streams_probe)

    @property
    def row_prefetch(self) -> int | None:
        """The prefetch distance the start-up timing kept (None: nothing was timed)."""
        return _fastest(self.row_prefetch_probe)

    def _choose_panel_row_prefetch(self, cached: StartupTimings | None = None) -> None:
        """Time one-row passes over the model's fp32 panels (in huge pages, where they
        now are) with each way of prefetching (`native.PANEL_ROW_PREFETCH_CHOICES`), and
        keep the fastest for the process. Zen 4: none, or 2 KiB ahead, took 0.79-0.84 of
        the next-panel scheme's time on one thread. With `cached`, an earlier start's
        figures instead."""
        def measure() -> dict[int, float]:
            panels = probe_panels(self.model)
            return native.time_panel_row_prefetch(panels) if panels else {}

        self.panel_prefetch_probe = _keep_fastest(
            None if cached is None else cached.panel_prefetch_probe, measure,
            native.set_panel_row_prefetch,
            "on fp32 panels prefetching the next panel (-1) or N bytes ahead")

    @property
    def panel_row_prefetch(self) -> int | None:
        """How one-row calls on panels prefetch, as the start-up timing kept (None:
        nothing was timed; the build's default, the next panel)."""
        return _fastest(self.panel_prefetch_probe)

    def _choose_panel_row_streams(self, cached: StartupTimings | None = None) -> None:
        """Then time one-row passes on the panels reading 1, 4 or 8 of them side by side
        (`native.PANEL_ROW_STREAMS_CHOICES`, with the prefetch just kept) and keep the
        fastest for calls of up to `native.PANEL_STREAM_ROWS` rows. Xeon Ice Lake: 4 to 8
        streams read 15-20% faster than one. With `cached`, an earlier start's figures
        instead."""
        def measure() -> dict[int, float]:
            panels = probe_panels(self.model)
            return native.time_panel_row_streams(panels) if panels else {}

        self.panel_streams_probe = _keep_fastest(
            None if cached is None else cached.panel_streams_probe, measure,
            native.set_panel_row_streams, "on fp32 panels reading N panels at once")

    @property
    def panel_row_streams(self) -> int | None:
        """How many panels calls of few rows read at once, as the start-up timing kept
        (None: nothing was timed; one)."""
        return _fastest(self.panel_streams_probe)

    def _weigh_native_decoder(self, use_decoder: Callable[[int], int], rounds: int = 5,
                              timed: dict[int, dict[str, float]] | None = None) -> None:
        """Decide how many rows the native decoder takes by timing whole decode steps:
        for each probed row count above those the plan already gives the native kernel
        (the linear probe's, then `DECODER_PROBE_ROWS`),
        a step on the current paths against one on the native kernel with the decoder,
        alternating (medians). The decoder takes each row count where it is faster, up to
        the first where it is not; the native kernel takes the same rows.

        Why whole steps: the decoder saves the Python between a step's calls, which the
        per-call probe cannot see. fp32 on a Xeon with AMX: torch's `linear` reads 5%
        faster per call at one row, yet a one-row step runs 17 against 22-24 ms with the
        decoder (docs/benchmarks.md, "CPU speed").

        Needs the plain weights: a plan that kept them (not "prepacked" alone). With
        `timed` (an earlier start's `decoder_probe`), its figures decide instead: the
        same row counts, the same rule, no step run."""
        from tasks.params import SamplingParams

        split = {module: module.plain_rows for module in self.model.modules()
                 if isinstance(module, LinearBase | ParallelLMHead)
                 and module.packed_weight is not None}

        planned = self.skinny_rows  # the rows the plan gave the native kernel

        def use(rows: int) -> int:
            """the decoder up to `rows` rows (0: none), the native kernel up to those or
            the plan's, whichever is more; a split's plain weight must reach them, as the
            prepacked copy is asked first"""
            use_native_kernel(self.model, max(planned, rows))
            for module, plain_rows in split.items():
                module.plain_rows = max(plain_rows, rows)
            return use_decoder(rows)

        accepted = self.decoder_rows  # the rows the decoder takes on the plan
        if use(max(accepted, 1)) == 0:  # the model cannot run the decoder
            use(accepted)
            return
        params = SamplingParams(temperature=0.0, max_tokens=1)
        started = time.perf_counter()
        for rows in sorted(m for m in {*self.linear_probe, *DECODER_PROBE_ROWS}
                           if m > accepted):
            if rows > min(self.max_num_seqs, self.num_blocks):
                break
            if timed is not None:
                if rows not in timed:  # that start stopped before these rows
                    break
                self.decoder_probe[rows] = timed[rows]
                if timed[rows]["decoder"] >= timed[rows]["plan"]:
                    break
                accepted = rows
                continue
            # one new token per sequence, each in its own block: a step of decode rows
            step = SchedulerOutput([ScheduledSequence(
                seq_id=i, token_ids=[0], start_pos=0, block_table=[i], sample=True,
                params=params, prompt_token_ids=[], output_token_ids=[])
                for i in range(rows)], rows)

            def step_once(step: SchedulerOutput = step) -> None:
                self.forward_logits(step)

            def put(name: str, rows: int = rows, plan: int = accepted) -> None:
                use(rows if name == "decoder" else plan)

            # a large model's step tells at once: it is timed in fewer rounds (that step
            # is the plan's warm-up)
            put("plan")
            started_step = time.perf_counter()
            step_once()
            slow = time.perf_counter() - started_step > SLOW_STEP_SECONDS
            self.decoder_probe[rows] = alternated_medians(
                {"plan": step_once, "decoder": step_once},
                min(rounds, SLOW_STEP_ROUNDS) if slow else rounds, prepare=put,
                warmed=("plan",))
            self.kv_cache[:rows].zero_()
            if self.decoder_probe[rows]["decoder"] >= self.decoder_probe[rows]["plan"]:
                break
            accepted = rows
        self.decoder_rows = use(accepted)
        if accepted > planned:
            self.skinny_rows = accepted
            if self.plain_rows is not None:
                self.plain_rows = max(self.plain_rows, accepted)
        logger.info("decode steps on the plan's paths / with the native decoder (ms, %s): "
                    "%s; the decoder takes up to %d rows",
                    "read from the start-up timings" if timed is not None
                    else f"timed in {time.perf_counter() - started:.1f} s",
                    ", ".join(f"{rows} rows {t['plan'] * 1e3:.2f} / {t['decoder'] * 1e3:.2f}"
                              for rows, t in self.decoder_probe.items()), self.decoder_rows)

    def _apply_linear_plan(self, plan: dense.LinearPlan) -> None:
        if plan.skinny_rows and not native.available():
            plan = fixed_plan("prepacked")  # "native" asked for where it cannot build
        self.linear_path = plan.name
        self.plain_rows, self.skinny_rows = plan.plain_rows, plan.skinny_rows
        # fp32 weights the native kernel takes are packed in panels for it (what
        # `time_paths` timed as "native" for them); the plain copy then serves no call a
        # prepacked copy does not take above the native kernel's rows, and is freed
        self.panel_weights = pack_panels(self.model) if plan.skinny_rows else 0
        plain_rows = plan.plain_rows
        if self.panel_weights and plain_rows is not None and plain_rows <= plan.skinny_rows:
            plain_rows = self.plain_rows = None
        num_packed = prepack_linears(self.model, plain_rows, self.widen) if plan.prepack else 0
        # (where copies are widened, bf16 cannot be packed as bf16: every packed one is)
        self.widened_weights = num_packed if self.widen else 0
        num_native = use_native_kernel(self.model, plan.skinny_rows) if plan.skinny_rows else 0
        if self.panel_weights and num_packed and plain_rows is None:
            drop_unused_plain_weights(self.model)  # the LM head's (tied: lookups move)
        parts = []
        if num_native:
            parts.append(f"native kernel ({native.isa()}"
                         f"{', fp32 panels' if self.panel_weights else ''}) up to "
                         f"{plan.skinny_rows} rows on {num_native} weights")
        if num_packed and plain_rows is not None and plain_rows > plan.skinny_rows:
            parts.append(f"torch's linear up to {plain_rows} rows")
        if num_packed:
            widened = f", {self.widened_weights} as fp32 copies" if self.widened_weights else ""
            parts.append(f"oneDNN prepacked above ({num_packed} weights{widened})" if parts
                         else f"{num_packed} weights prepacked for oneDNN{widened}")
        elif parts:
            parts.append("torch's linear above")
        logger.info("linear path on %s, %s: %s (%s)", self.device, self.dtype, plan.name,
                    "; ".join(parts) or "torch's linear")

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.shape[0]

    @property
    def block_size(self) -> int:
        return self._block_shape[2]

    @property
    def vocab_size(self) -> int:
        """Rows of the embedding (config.json `vocab_size`): every token id is below it."""
        return self.loaded.config.vocab_size

    @property
    def block_shape(self) -> tuple[int, ...]:
        """[2, num_layers, block_size, num_kv_heads (of this rank), head_dim]"""
        return self._block_shape

    @property
    def bytes_per_block(self) -> int:
        return self._bytes_per_block

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run the step and sample one token for each sequence with `sample=True`."""
        with torch.inference_mode():
            logits, seqs = self._step_logits(out)
            if logits is None:
                return ModelRunnerOutput(seq_ids=[], sampled_token_ids=[], logprobs=[])
            if self._sample is None:
                from workers.engine.sampler import sample

                self._sample = sample
            token_ids, logprobs = self._sample(logits, seqs,
                                               eos_token_ids=self.loaded.eos_token_ids,
                                               grammar_bitmask=out.grammar_bitmask)
        return ModelRunnerOutput(seq_ids=[s.seq_id for s in seqs],
                                 sampled_token_ids=token_ids, logprobs=logprobs)

    def set_yield_check(self, check: Callable[[int], bool] | None,
                        decoder_stop: Callable[[], tuple[native.StopFlag, int] | None]
                        | None = None) -> int:
        """Ask `check(layer_index)` before each layer of the layer loop (None: never);
        True stops the step there (`workers.engine.errors.StepInterrupted`). Returns the
        number of layers, or 0 when this runner cannot stop a step: the ranks of a
        tensor-parallel group run each layer's collectives together, so none stops alone.
        `decoder_stop` (`LlamaForCausalLM.set_yield_check`): the flag the native decoder
        reads between layers."""
        setter = getattr(self.model, "set_yield_check", None)
        if self.loaded.tp_size > 1 or setter is None:
            return 0
        setter(check, decoder_stop)
        return self.loaded.config.num_layers

    def execute_shard(self, out: SchedulerOutput) -> None:
        """A non-driver TP rank's part of `execute`: the same forward and logits
        collectives, no sampling (rank 0 samples from the gathered logits)."""
        with torch.inference_mode():
            self._step_logits(out)

    def forward_logits(self, out: SchedulerOutput) -> torch.Tensor:
        """float32 logits [num_batched_tokens, vocab] of every scheduled token (for tests)."""
        with torch.inference_mode():
            return self.model.compute_logits(self._forward(out))

    def read_blocks(self, block_ids: list[int]) -> list[bytes]:
        """The raw bytes of each block's slab (K and V of every layer), in order."""
        if not block_ids:
            return []
        with torch.inference_mode():
            slabs = self.kv_cache[torch.tensor(block_ids, device=self.device)].cpu()
        raw = slabs.view(len(block_ids), -1).view(torch.uint8)
        return [row.numpy().tobytes() for row in raw]

    def write_blocks(self, items: list[tuple[int, bytes]]) -> None:
        """Fill blocks from blobs that `read_blocks` produced (same model, dtype, block size)."""
        if not items:
            return
        for block_id, blob in items:
            if len(blob) != self._bytes_per_block:
                raise ValueError(
                    f"KV blob for block {block_id} has {len(blob)} bytes, expected "
                    f"{self._bytes_per_block}: it was written for another model, dtype or "
                    f"block size"
                )
            if not 0 <= block_id < self.num_blocks:
                raise ValueError(f"block id {block_id} outside 0..{self.num_blocks - 1}")
        buf = bytearray(b"".join(blob for _, blob in items))
        slabs = torch.frombuffer(buf, dtype=torch.uint8).view(self.dtype)
        slabs = slabs.view(len(items), *self._block_shape).to(self.device)
        ids = torch.tensor([block_id for block_id, _ in items], device=self.device)
        with torch.inference_mode():
            self.kv_cache[ids] = slabs

    # -- one step -----------------------------------------------------------------------

    def _forward(self, out: SchedulerOutput) -> torch.Tensor:
        if len(out.scheduled) > self.max_num_seqs:
            raise ValueError(f"{len(out.scheduled)} sequences exceed max_num_seqs="
                             f"{self.max_num_seqs}")
        if out.num_batched_tokens > self.max_num_batched_tokens:
            raise ValueError(f"{out.num_batched_tokens} tokens exceed max_num_batched_tokens="
                             f"{self.max_num_batched_tokens}")
        self.write_blocks(out.blocks_to_load)
        input_ids, positions, meta = self._prepare(out.scheduled)
        return self.model(input_ids, positions, meta)

    def _step_logits(
        self, out: SchedulerOutput
    ) -> tuple[torch.Tensor | None, list[ScheduledSequence]]:
        """float32 logits [num_sampling_seqs, vocab] of the step (None if none samples)."""
        hidden = self._forward(out)
        rows, seqs = self._sample_rows(out)
        if not seqs:
            return None, seqs
        return self.model.compute_logits(hidden[rows]), seqs

    def _prepare(self, scheduled: list[ScheduledSequence]):
        """Flatten the step into input_ids, positions [num_tokens] and attention metadata."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        spans: list[tuple[int, int, list[int]]] = []
        for seq in scheduled:
            n, start = len(seq.token_ids), seq.start_pos
            num_blocks = -(-(start + n) // bs)
            if n == 0 or len(seq.block_table) < num_blocks:
                raise ValueError(
                    f"sequence {seq.seq_id}: {n} tokens from position {start} need "
                    f"{num_blocks} blocks, block_table has {len(seq.block_table)}"
                )
            input_ids.extend(seq.token_ids)
            positions.extend(range(start, start + n))
            spans.append((start, n, seq.block_table))
        meta = build_attention_metadata(self.kv_cache, spans, self.chunks_as_decodes)
        dev = self.device
        return (torch.tensor(input_ids, dtype=torch.int64, device=dev),
                torch.tensor(positions, dtype=torch.int64, device=dev), meta)

    @staticmethod
    def _sample_rows(out: SchedulerOutput) -> tuple[list[int], list[ScheduledSequence]]:
        rows: list[int] = []
        seqs: list[ScheduledSequence] = []
        row = 0
        for seq in out.scheduled:
            row += len(seq.token_ids)
            if seq.sample:
                rows.append(row - 1)
                seqs.append(seq)
        return rows, seqs


def widened_copies_fit(model: torch.nn.Module, ranks_on_host: int = 1) -> bool:
    """True when fp32 copies of `model`'s bf16 projection weights that cannot be packed as
    bf16 on this CPU (`dense.can_prepack_widened`: no bf16 dot products) would take at
    most `WIDENED_COPIES_MEMORY_SHARE` of the memory available now; False when there are
    none. The plain bf16 weights stay for the native kernel's few rows, so the copies add
    twice their bytes. `ranks_on_host`: shards of the model on this host making their
    copies at the same time (a CPU tensor-parallel group's ranks), each of which may take
    that many times less."""
    weights = {id(m.weight): m.weight for m in model.modules()
               if isinstance(m, LinearBase | ParallelLMHead)
               and dense.can_prepack_widened(m.weight)}
    copies = sum(2 * w.numel() * w.element_size() for w in weights.values())
    if not copies:
        return False
    available = available_memory()
    fits = (available is not None
            and copies * ranks_on_host <= WIDENED_COPIES_MEMORY_SHARE * available)
    if not fits:
        logger.info("bf16 weights stay plain for every call: fp32 copies for the calls of "
                    "many rows would take %.1f GB of %s available", copies / 1e9,
                    "unknown" if available is None else f"{available / 1e9:.1f} GB")
    return fits


def available_memory() -> int | None:
    """Bytes of memory available to start new work (/proc/meminfo MemAvailable), None
    where that is unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _fastest(times: dict[int, float]) -> int | None:
    """The choice of least time (None: nothing was timed)."""
    # (`get` is typed float | None: every key has a value)
    return min(times, key=cast(Callable[[int], float], times.get)) if times else None


def _keep_fastest(cached: dict[int, float] | None, measure: Callable[[], dict[int, float]],
                  keep: Callable[[int], None], what: str) -> dict[int, float]:
    """The seconds of one-row passes per prefetch choice, `cached` (an earlier start's) or
    measured now (`measure`; logged as one-row passes `what`); the fastest is `keep`-ed
    for the process. Returns the figures (empty: nothing timed, the default stays)."""
    started = time.perf_counter()
    times = cached if cached is not None else measure()
    if times:
        keep(cast(int, _fastest(times)))  # (times is not empty)
        if cached is None:
            logger.info("one-row passes %s (ms, in %.1f s): %s; keeping %d", what,
                        time.perf_counter() - started,
                        ", ".join(f"{n} {t * 1e3:.2f}" for n, t in times.items()),
                        _fastest(times))
    return times


def linear_path_setting() -> str:
    """The linear path `LLMQ_LINEAR_PATH` asks for (`auto` when unset).

    NOTE: the timing of `auto` may choose differently in two processes on a busy machine,
    and fp32 results of the paths differ in the last bits: pin the path where processes
    must agree to the bit (the test suite does)."""
    return check_linear_path(os.environ.get(LINEAR_PATH_ENV, "auto"), LINEAR_PATH_ENV)


def check_linear_path(value: str, name: str = "linear_path") -> str:
    path = value.strip().lower()
    if path not in LINEAR_PATHS:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(LINEAR_PATHS)}")
    return path


STEP_KERNELS_ENV = "LLMQ_CPU_KERNELS"


def step_kernels_setting() -> str:
    """`LLMQ_CPU_KERNELS`: `native` (default) runs a step's small operations on the CPU
    with the native kernels (kernels/native.py) where they build; `reference` keeps the
    pure-torch ones. The choice is the process's (kernels.dispatch)."""
    value = os.environ.get(STEP_KERNELS_ENV, "native").strip().lower()
    if value not in ("native", "reference"):
        raise ValueError(f"{STEP_KERNELS_ENV}={value!r}: expected native or reference")
    return value


def fixed_plan(path: str) -> dense.LinearPlan:
    """The plan a linear path asked for by name means (no timing)."""
    if path == "prepacked":
        return dense.LinearPlan("prepacked", prepack=True)
    if path == "split":
        return dense.LinearPlan("split", prepack=True, plain_rows=dense.PROBE_BATCH_SIZES[0])
    if path == "native":
        return dense.LinearPlan("native", prepack=True, plain_rows=NATIVE_ROWS,
                                skinny_rows=NATIVE_ROWS)
    return dense.LinearPlan("reference")
