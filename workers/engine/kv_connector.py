"""`KVConnector`: how the scheduler talks to KV storage below the device cache.

The scheduler side of vLLM v1's connector shape. The scheduler knows nothing of tiers,
Redis or payloads; it calls, from the engine's thread only:

* at the start of each step, `take_finished_lookups()`: sequences whose lookup finished
  since the last step leave `SequenceStatus.WAITING_FOR_REMOTE_KVS` and are scheduled
  normally again;
* on admission, after the device prefix hit, `get_num_new_matched_tokens(...)`: how many
  tokens the connector can supply beyond the device hit; `None` means "still looking,
  ask again once `take_finished_lookups` names it" (the sequence waits, the others run);
* after allocating blocks for an admitted sequence, `update_state_after_alloc(...)`: the
  connector queues the loads of the tokens it promised (possibly zero: forget the lookup);
* when building the step's output, `build_connector_meta(...)`: the queued loads go into
  `SchedulerOutput.blocks_to_load`, which the runner writes before the forward pass;
* when a step schedules nothing and sequences wait for lookups, `wait_for_lookups(...)`;
* when a sequence ends, right before its blocks are freed, `request_finished(...)`.

NOTE: a connector must never block a step: a slow lookup returns `None` and runs on its
own thread; a failing one is a miss, never an exception.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from kvcache.hashing import BlockHash

if TYPE_CHECKING:
    from workers.engine.sequence import Sequence
    from workers.engine.step_io import SchedulerOutput


class KVConnector(Protocol):
    """The scheduler's view of the KV storage below the device (tiers, remote caches)."""

    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int,
                                   num_free_blocks: int) -> tuple[int | None, bool]:
        """(tokens the connector can supply after `num_computed_tokens`, load is async).

        `num_computed_tokens` is the device hit (a multiple of the block size);
        `num_free_blocks` bounds how much may be fetched (the device cannot load more:
        a lookup holds its payloads in host memory until admission). The count is a
        multiple of the block size and leaves at least the last prompt token to compute.
        `None`: a lookup is in flight; the sequence waits in
        `WAITING_FOR_REMOTE_KVS` until `take_finished_lookups` names it.
        """
        ...

    def update_state_after_alloc(self, seq: Sequence, blocks: list[int],
                                 num_external_tokens: int) -> None:
        """`blocks` is the sequence's new block table; the `num_external_tokens` tokens
        right after the device hit go into its blocks from index
        `num_computed_tokens // block_size` on: queue their loads. Called after every
        admission (with 0 when none were loaded)."""
        ...

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> None:
        """Hand this step's queued loads to the runner (`scheduler_output.blocks_to_load`)."""
        ...

    def take_finished_lookups(self) -> list[int]:
        """Seq ids whose lookup finished since the last call (each named once)."""
        ...

    def wait_for_lookups(self, timeout: float) -> None:
        """Nothing else can run this step: block up to `timeout` seconds until some lookup
        finishes (spares the engine a busy loop; never called while others could run)."""
        ...

    def request_finished(self, seq: Sequence, blocks: list[tuple[int, BlockHash]]) -> None:
        """`seq` ended; `blocks` are its full blocks no running sequence holds,
        `(block id, hash)`. The connector picks which to offload and reads their bytes
        before returning (the blocks are freed right after). Never raises."""
        ...

    def figures(self) -> dict[str, dict[str, float]]:
        """Cumulative counters for the heartbeat: {store name: {figure: value}}."""
        ...

    def close(self, timeout: float | None = 10.0) -> None:
        """Finish queued writes (up to `timeout`) and release threads and connections."""
        ...
