"""Random add / step / abort against the scheduler and a tiny KV cache, checking the
block bookkeeping and the per-step budgets after every rule (hypothesis stateful)."""

from __future__ import annotations

import itertools
from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcache.kv_cache_manager import KVCacheManager
from tasks.params import SamplingParams
from workers.engine.scheduler import Scheduler
from workers.engine.sequence import Sequence, SequenceStatus
from workers.engine.step_io import ModelRunnerOutput

EOS = 2
BLOCK_SIZE = 4
NUM_BLOCKS = 12  # small enough that a few sequences force preemption
MAX_NUM_SEQS = 4
MAX_NUM_BATCHED_TOKENS = 16
# a few fixed prefixes so that prompts share blocks and hit the prefix cache
PREFIXES = [[], list(range(10, 18)), list(range(20, 25))]


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=True)
        self.sched = Scheduler(
            self.kv,
            max_num_seqs=MAX_NUM_SEQS,
            max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
            max_model_len=64,
            eos_token_ids=[EOS],
            long_prefill_token_threshold=6,
        )
        self.ids = itertools.count()
        self.requests: dict[str, list[Sequence]] = {}

    @rule(
        prefix=st.sampled_from(range(len(PREFIXES))),
        tail=st.lists(st.integers(3, 9), min_size=1, max_size=12),
        max_tokens=st.integers(1, 12),
        n=st.integers(1, 3),
        priority=st.integers(0, 2),
        ignore_eos=st.booleans(),
    )
    def add(
        self,
        prefix: int,
        tail: list[int],
        max_tokens: int,
        n: int,
        priority: int,
        ignore_eos: bool,
    ) -> None:
        prompt = PREFIXES[prefix] + tail
        # the engine rejects what the cache can never hold; so must the generator here
        max_tokens = min(max_tokens, NUM_BLOCKS * BLOCK_SIZE - len(prompt))
        params = SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=ignore_eos)
        arrival = next(self.ids)
        request_id = f"r{arrival}"
        seqs = [
            Sequence(next(self.ids), request_id, i, prompt, params, priority, arrival)
            for i in range(n)
        ]
        self.requests[request_id] = seqs
        self.sched.add_seqs(seqs)

    @rule()
    def step(self) -> None:
        out = self.sched.schedule()
        assert out.num_batched_tokens == sum(len(s.token_ids) for s in out.scheduled)
        assert out.num_batched_tokens <= MAX_NUM_BATCHED_TOKENS
        assert len(out.scheduled) <= MAX_NUM_SEQS
        assert len({s.seq_id for s in out.scheduled}) == len(out.scheduled)
        for s in out.scheduled:
            assert 0 < len(s.token_ids) <= 6  # long_prefill_token_threshold
            end = s.start_pos + len(s.token_ids)
            assert len(s.block_table) * BLOCK_SIZE >= end
            assert s.seq_id not in out.preempted_seq_ids
        seq_ids = [s.seq_id for s in out.scheduled if s.sample]
        tokens = [
            (i * 7 + len(s.output_token_ids)) % 11
            for i, s in ((s.seq_id, s) for s in out.scheduled if s.sample)
        ]
        self.sched.update_from_output(out, ModelRunnerOutput(seq_ids, tokens, [None] * len(tokens)))
        for seqs in self.requests.values():
            for seq in seqs:
                if seq.is_finished and seq.status != SequenceStatus.FINISHED_ABORTED:
                    assert seq.num_output_tokens <= seq.params.max_tokens

    @precondition(lambda self: bool(self.requests))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.requests)))
        self.sched.finish_seqs(self.requests.pop(request_id), SequenceStatus.FINISHED_ABORTED)

    @invariant()
    def block_bookkeeping(self) -> None:
        refs: Counter[int] = Counter()
        for seq in self.sched.seqs.values():
            table = self.kv.get_block_ids(seq.seq_id)
            if seq.status != SequenceStatus.RUNNING:
                assert table == [], "only running sequences hold blocks"
            refs.update(table)
        pool = self.kv.block_pool
        free = {b.block_id for b in pool.free_block_queue}
        for block in pool.blocks:
            assert block.ref_cnt == refs[block.block_id]
            assert not (block.block_id in free and block.ref_cnt > 0)
        used = sum(1 for b in pool.blocks if b.ref_cnt > 0)
        assert len(free) + used == NUM_BLOCKS == self.kv.num_free_blocks + used

    @invariant()
    def queues_consistent(self) -> None:
        sched = self.sched
        held = [s for group in sched.deferred.values() for s in group]
        queued = sched.running + sched.waiting + held
        assert len(queued) == len({id(s) for s in queued}) == len(sched.seqs)
        assert all(not s.is_finished for s in queued)
        assert len(sched.running) <= MAX_NUM_SEQS
        assert all(s.status == SequenceStatus.RUNNING for s in sched.running)

    def teardown(self) -> None:
        # drain: everything left must finish, and then nothing may remain anywhere
        for _ in range(2000):
            if not self.sched.has_unfinished_seqs():
                break
            self.step()
        assert not self.sched.has_unfinished_seqs()
        assert not self.sched.running and not self.sched.waiting and not self.sched.deferred
        assert self.kv.num_free_blocks == NUM_BLOCKS
        assert all(b.ref_cnt == 0 for b in self.kv.block_pool.blocks)
        assert not self.kv._seqs


TestScheduler = SchedulerMachine.TestCase
TestScheduler.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_preemption_is_exercised() -> None:
    """The budgets above do force preemption (so the machine checks that path)."""
    machine = SchedulerMachine()
    for i in range(4):
        machine.add(prefix=0, tail=[3 + i] * 10, max_tokens=12, n=1, priority=0, ignore_eos=True)
    for _ in range(30):
        machine.step()
    assert machine.sched.num_preemptions > 0
    machine.teardown()
