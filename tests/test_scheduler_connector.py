"""The scheduler with a KV connector: lookups in flight never hold back other sequences.

A fake runner keeps each block's token ids as its "KV" and samples from everything a
sequence's block table holds, so a block loaded into the wrong place (or not loaded)
changes the output. A test connector keeps blocks in a dict and answers a lookup only
when the test releases it.
"""

from __future__ import annotations

import itertools

from kvcache.hashing import BlockHash, hash_full_blocks
from kvcache.kv_cache_manager import KVCacheManager
from tasks.params import SamplingParams
from workers.engine.kv_connector import KVConnector
from workers.engine.scheduler import Scheduler
from workers.engine.sequence import Sequence, SequenceStatus
from workers.engine.step_io import ModelRunnerOutput, SchedulerOutput

BS = 4  # tokens per block
_ids = itertools.count()


class KVRunner:
    """A runner whose KV cache holds token ids: block id -> the token at each slot."""

    def __init__(self) -> None:
        self.kv: dict[int, list[int]] = {}

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for block_id, payload in out.blocks_to_load:
            self.kv[block_id] = list(payload)
        for s in out.scheduled:
            for offset, token in enumerate(s.token_ids):
                pos = s.start_pos + offset
                self.kv.setdefault(s.block_table[pos // BS], [0] * BS)[pos % BS] = token
        seq_ids, sampled = [], []
        for s in out.scheduled:
            if s.sample:
                end = s.start_pos + len(s.token_ids)
                context = [self.kv[s.block_table[p // BS]][p % BS] for p in range(end)]
                seq_ids.append(s.seq_id)
                sampled.append(10 + sum((i + 1) * t for i, t in enumerate(context)) % 200)
        return ModelRunnerOutput(seq_ids, sampled, [None] * len(seq_ids))

    def read_blocks(self, block_ids: list[int]) -> list[bytes]:
        return [bytes(self.kv[block_id]) for block_id in block_ids]


class HeldConnector:
    """A `KVConnector` over a dict of blocks; a lookup of a seq in `hold` stays in
    flight until `release`, the others finish at the next step (like a fast tier)."""

    def __init__(self, runner: KVRunner, store: dict[BlockHash, bytes],
                 hold: tuple[int, ...] = ()) -> None:
        self.runner = runner
        self.store = store
        self.hold = set(hold)
        self.in_flight: set[int] = set()
        self.answers: dict[int, tuple[int, list[bytes]]] = {}  # seq id -> (start, payloads)
        self.first_block: dict[int, int] = {}
        self.to_load: list[tuple[int, bytes]] = []
        self.num_lookups = 0

    def release(self, seq_id: int) -> None:
        self.hold.discard(seq_id)

    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int,
                                   num_free_blocks: int) -> tuple[int | None, bool]:
        start = num_computed_tokens // BS
        if seq.seq_id in self.in_flight:
            return None, False
        if seq.seq_id not in self.answers:
            if (seq.num_tokens - 1) // BS <= start:
                return 0, False  # no full block to look up
            hashes = hash_full_blocks(seq.token_ids[:(seq.num_tokens - 1) // BS * BS], BS)
            payloads = []
            for block_hash in hashes[start:]:
                if block_hash not in self.store:
                    break
                payloads.append(self.store[block_hash])
            self.answers[seq.seq_id] = (start, payloads[:max(0, num_free_blocks - 1)])
            self.in_flight.add(seq.seq_id)
            self.num_lookups += 1
            return None, False
        found_start, payloads = self.answers[seq.seq_id]
        self.first_block[seq.seq_id] = start
        if start < found_start:
            return 0, False
        return (len(payloads) - (start - found_start)) * BS, False

    def update_state_after_alloc(self, seq: Sequence, blocks: list[int],
                                 num_external_tokens: int) -> None:
        found_start, payloads = self.answers.pop(seq.seq_id, (0, []))
        first = self.first_block.pop(seq.seq_id, 0)
        num = num_external_tokens // BS
        skip = first - found_start
        self.to_load += zip(blocks[first:first + num], payloads[skip:skip + num])

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> None:
        scheduler_output.blocks_to_load, self.to_load = self.to_load, []

    def take_finished_lookups(self) -> list[int]:
        finished = sorted(self.in_flight - self.hold)
        self.in_flight -= set(finished)
        return finished

    def wait_for_lookups(self, timeout: float) -> None:
        pass

    def request_finished(self, seq: Sequence, blocks: list[tuple[int, BlockHash]]) -> None:
        self.in_flight.discard(seq.seq_id)
        self.answers.pop(seq.seq_id, None)
        payloads = self.runner.read_blocks([block_id for block_id, _ in blocks])
        self.store.update((block_hash, payload)
                          for (_, block_hash), payload in zip(blocks, payloads))

    def figures(self) -> dict[str, dict[str, float]]:
        return {}

    def close(self, timeout: float | None = 10.0) -> None:
        pass


def make(connector_of=None, num_blocks: int = 32) -> tuple[Scheduler, KVRunner, object]:
    runner = KVRunner()
    connector: KVConnector | None = connector_of(runner) if connector_of else None
    sched = Scheduler(KVCacheManager(num_blocks, BS), max_num_seqs=4,
                      max_num_batched_tokens=32, max_model_len=128, kv_connector=connector)
    return sched, runner, connector


def add(sched: Scheduler, prompt: list[int], max_tokens: int = 5) -> Sequence:
    arrival = next(_ids)
    seq = Sequence(next(_ids), f"r{arrival}", 0, list(prompt),
                   SamplingParams(max_tokens=max_tokens), arrival=arrival)
    sched.add_seqs([seq])
    return seq


def step(sched: Scheduler, runner: KVRunner) -> SchedulerOutput:
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    return out


def run_alone(prompt: list[int]) -> list[int]:
    sched, runner, _ = make()
    seq = add(sched, prompt)
    while sched.has_unfinished_seqs():
        step(sched, runner)
    return seq.output_token_ids


PROMPT = [11, 12, 13, 14, 21, 22, 23, 24, 31, 32, 33, 34, 41, 42]  # 3 full blocks + 2


def test_a_held_lookup_waits_while_others_run_then_loads_and_matches_a_fresh_run() -> None:
    expected = run_alone(PROMPT)
    store: dict[BlockHash, bytes] = {}
    # group 1 computes the prompt; at its end the full blocks go to the store
    first, runner, _ = make(lambda r: HeldConnector(r, store))
    add(first, PROMPT)
    while first.has_unfinished_seqs():
        step(first, runner)
    assert len(store) == 4  # 14 prompt + 5 output tokens: 4 full blocks

    # group 2, a cold device: the prompt's lookup is held while other sequences run
    second, runner, _ = make(lambda r: HeldConnector(r, store))
    connector = second.kv_connector
    assert isinstance(connector, HeldConnector)
    other = add(second, [60 + i for i in range(6)], max_tokens=8)
    step(second, runner)
    step(second, runner)  # other's lookup (a miss) answered: it runs
    assert other.status == SequenceStatus.RUNNING
    held = add(second, PROMPT)
    connector.hold.add(held.seq_id)
    # behind the held one; one block only (no lookup: its last token is computed anyway)
    later = add(second, [90 + i for i in range(4)], max_tokens=8)
    for index in range(4):
        out = step(second, runner)
        if index == 0:  # admitted in the very step the held lookup started
            assert later.seq_id in {s.seq_id for s in out.scheduled}
        assert held.status == SequenceStatus.WAITING_FOR_REMOTE_KVS
        assert held.seq_id not in {s.seq_id for s in out.scheduled}
        assert other.seq_id in {s.seq_id for s in out.scheduled}
    # the sequence behind the held one was admitted and ran meanwhile
    assert later.status == SequenceStatus.RUNNING and later.num_output_tokens >= 2
    assert second.num_waiting_for_kvs == 1

    connector.release(held.seq_id)
    out = step(second, runner)
    (chunk,) = [s for s in out.scheduled if s.seq_id == held.seq_id]
    # the three stored blocks load into its first three blocks; 2 tokens are computed
    assert [block_id for block_id, _ in out.blocks_to_load] == held.block_table[:3]
    assert [payload for _, payload in out.blocks_to_load] == [
        bytes(PROMPT[i:i + BS]) for i in range(0, 12, BS)]
    assert chunk.start_pos == 12 and chunk.token_ids == PROMPT[12:]
    assert held.num_cached_tokens == 12 and second.num_waiting_for_kvs == 0
    while second.has_unfinished_seqs():
        step(second, runner)
    assert held.output_token_ids == expected
    assert connector.num_lookups == 2  # other's and held's


def test_a_miss_computes_and_an_abort_in_flight_releases_everything() -> None:
    longer = PROMPT + [51, 52, 53, 54]  # 4 full blocks + 2; the 4th was never computed
    expected = run_alone(longer)
    sched, runner, connector = make(lambda r: HeldConnector(r, {}))
    assert isinstance(connector, HeldConnector)
    warm = add(sched, PROMPT, max_tokens=1)  # puts blocks 0-2 in the device cache
    while sched.has_unfinished_seqs():
        step(sched, runner)
    assert warm.is_finished
    # the device hit of a sequence whose lookup is in flight stays referenced
    aborted = add(sched, longer)
    connector.hold.add(aborted.seq_id)
    free = sched.kv_manager.num_free_blocks
    step(sched, runner)
    assert aborted.status == SequenceStatus.WAITING_FOR_REMOTE_KVS
    assert len(aborted.block_table) == 3 and sched.kv_manager.num_free_blocks == free - 3
    sched.finish_seqs([aborted], SequenceStatus.FINISHED_ABORTED)
    assert sched.num_waiting_for_kvs == 0 and not sched.has_unfinished_seqs()
    assert sched.kv_manager.num_free_blocks == free  # cached again, evictable
    # a miss computes: the store has nothing beyond the device hit
    seq = add(sched, longer)
    while sched.has_unfinished_seqs():
        out = step(sched, runner)
        assert out.blocks_to_load == []
    assert seq.output_token_ids == expected and seq.num_cached_tokens == 12
    assert connector.num_lookups == 3  # warm, aborted, seq: each asked once
