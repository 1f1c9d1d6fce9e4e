"""Our runner's greedy tokens and prompt logits equal Hugging Face `transformers` on random
Qwen3, Qwen2 and Llama (llama3 rope scaling) checkpoints, fp32.

A small hand driver plays the scheduler: it allocates KV blocks from a shuffled free list
(so block tables are never contiguous) and builds each step's `SchedulerOutput`: alone,
several sequences per step (decodes batched), and prompts split into chunks while other
sequences decode.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from tasks.params import SamplingParams
from workers.engine.loader import load_checkpoint
from workers.engine.model_runner import ModelRunner
from workers.engine.step_io import ScheduledSequence, SchedulerOutput

BLOCK_SIZE = 16
PROMPT_LENS = [1, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 300]
NUM_NEW_TOKENS = 64
ARCH_FIXTURES = ["tiny_qwen3_dir", "tiny_qwen2_dir", "tiny_llama_dir"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core machine the
    thread hand-offs cost more than the work: run this module single-threaded."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _greedy(runner: ModelRunner, out: SchedulerOutput) -> list[int]:
    """One step's sampled tokens: through the runner's sampler when it exists."""
    try:
        import workers.engine.sampler  # noqa: F401
    except ImportError:
        logits = runner.forward_logits(out)
        rows, _ = runner._sample_rows(out)
        return logits[rows].argmax(-1).tolist()
    return runner.execute(out).sampled_token_ids


@dataclass
class _Seq:
    seq_id: int
    prompt: list[int]
    chunk_sizes: list[int]  # prompt chunk sizes, cycled; the last chunk is cut to fit
    output: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


class HandDriver:
    """Plays the scheduler for a set of sequences until each has NUM_NEW_TOKENS outputs."""

    def __init__(self, runner: ModelRunner, seed: int = 0) -> None:
        self.runner = runner
        self.free = list(range(runner.num_blocks))
        random.Random(seed).shuffle(self.free)
        self.seqs: list[_Seq] = []

    def add(self, prompt: list[int], chunk_sizes: list[int] | None = None) -> _Seq:
        seq = _Seq(len(self.seqs), list(prompt), chunk_sizes or [len(prompt)])
        self.seqs.append(seq)
        return seq

    def _schedule(self, seq: _Seq) -> ScheduledSequence:
        tokens = seq.tokens
        if seq.num_computed < len(seq.prompt):
            done = sum(1 for _ in self._chunks_so_far(seq))
            size = seq.chunk_sizes[done % len(seq.chunk_sizes)]
            chunk = tokens[seq.num_computed: seq.num_computed + size]
        else:
            chunk = tokens[seq.num_computed:]
        end = seq.num_computed + len(chunk)
        while len(seq.block_table) * BLOCK_SIZE < end:
            seq.block_table.append(self.free.pop())
        return ScheduledSequence(
            seq_id=seq.seq_id, token_ids=chunk, start_pos=seq.num_computed,
            block_table=seq.block_table, sample=end == len(tokens), params=GREEDY,
            prompt_token_ids=seq.prompt, output_token_ids=seq.output,
        )

    @staticmethod
    def _chunks_so_far(seq: _Seq):
        pos, i = 0, 0
        while pos < seq.num_computed:
            pos += seq.chunk_sizes[i % len(seq.chunk_sizes)]
            i += 1
            yield i

    def step(self, seqs: list[_Seq]) -> None:
        scheduled = [self._schedule(s) for s in seqs if len(s.output) < NUM_NEW_TOKENS]
        out = SchedulerOutput(scheduled, sum(len(s.token_ids) for s in scheduled))
        sampled = iter(_greedy(self.runner, out))
        for sched in scheduled:
            seq = self.seqs[sched.seq_id]
            seq.num_computed += len(sched.token_ids)
            if sched.sample:
                seq.output.append(next(sampled))

    def run(self, seqs: list[_Seq] | None = None) -> None:
        seqs = self.seqs if seqs is None else seqs
        while any(len(s.output) < NUM_NEW_TOKENS for s in seqs):
            self.step(seqs)


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1234)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module", params=ARCH_FIXTURES)
def case(request):
    """(loaded checkpoint, prompts, HF greedy outputs per prompt) for one architecture."""
    from transformers import AutoModelForCausalLM

    model_dir = request.getfixturevalue(request.param)
    loaded = load_checkpoint(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    prompts = _prompts(loaded.config.vocab_size)
    refs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=NUM_NEW_TOKENS, eos_token_id=None, pad_token_id=0)
            refs.append(out[0, len(prompt):].tolist())
    assert all(len(r) == NUM_NEW_TOKENS for r in refs)
    # the random weights must make greedy decoding depend on the context
    assert len({tuple(r) for r in refs}) == len(refs)
    return loaded, prompts, refs, hf


def _runner(loaded) -> ModelRunner:
    return ModelRunner(loaded, block_size=BLOCK_SIZE, kv_cache_bytes=2 << 20)


def test_alone_matches_hf_generate(case):
    loaded, prompts, refs, _ = case
    runner = _runner(loaded)
    for prompt, ref in zip(prompts, refs):
        driver = HandDriver(runner, seed=len(prompt))
        seq = driver.add(prompt)
        driver.run()
        assert seq.output == ref, f"prompt of {len(prompt)} tokens"


def test_one_batch_matches_hf_generate(case):
    loaded, prompts, refs, _ = case
    driver = HandDriver(_runner(loaded))
    seqs = [driver.add(p) for p in prompts]
    driver.run()  # step 1: every prompt at once; then all decodes batched
    assert [s.output for s in seqs] == refs


def test_chunked_prefill_beside_decodes_matches_hf_generate(case):
    loaded, prompts, refs, _ = case
    driver = HandDriver(_runner(loaded), seed=7)
    # two short sequences start first and are decoding while the others arrive chunked
    early = [driver.add(prompts[0]), driver.add(prompts[1], chunk_sizes=[4, 1, 8])]
    for _ in range(3):
        driver.step(early)
    late = [
        driver.add(prompts[4], chunk_sizes=[1, 7, 16, 50, 33]),  # odd sizes cross blocks
        driver.add(prompts[3], chunk_sizes=[16]),  # block-aligned chunks
        driver.add(prompts[2], chunk_sizes=[5, 11]),
    ]
    driver.run(early + late)
    by_prompt = {len(s.prompt): s.output for s in early + late}
    assert [by_prompt[len(p)] for p in prompts] == refs


def test_prompt_logits_match_hf(case):
    loaded, prompts, _, hf = case
    prompt = prompts[-1]
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    driver = HandDriver(_runner(loaded))
    whole = driver.add(prompt)
    out = SchedulerOutput([driver._schedule(whole)], len(prompt))
    logits = driver.runner.forward_logits(out)
    assert logits.dtype == torch.float32 and logits.shape == ref.shape
    assert (logits - ref).abs().max().item() < 1e-4
    # the same prompt in chunks after a cached prefix gives the same rows
    chunked = driver.add(prompt, chunk_sizes=[100, 37, 163])
    rows = []
    while chunked.num_computed < len(prompt):
        sched = driver._schedule(chunked)
        rows.append(driver.runner.forward_logits(SchedulerOutput([sched], len(sched.token_ids))))
        chunked.num_computed += len(sched.token_ids)
    assert (torch.cat(rows) - ref).abs().max().item() < 1e-4


def test_a_long_prompt_step_runs_its_mlp_in_chunks_and_matches_hf(case):
    """An fp32 prompt step of more than twice `MLP_CHUNK_ROWS` rows runs its MLP in
    chunks (the last one short): its logits are HF's on the whole prompt."""
    from workers.engine.models.llama import MLP_CHUNK_ROWS

    loaded, _, _, hf = case
    num_tokens = 2 * MLP_CHUNK_ROWS + 77
    prompt = torch.randint(3, loaded.config.vocab_size, (num_tokens,),
                           generator=torch.Generator().manual_seed(5)).tolist()
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    runner = ModelRunner(loaded, block_size=BLOCK_SIZE, kv_cache_bytes=8 << 20)
    driver = HandDriver(runner)
    whole = driver.add(prompt)
    logits = runner.forward_logits(SchedulerOutput([driver._schedule(whole)], num_tokens))
    assert logits.shape == ref.shape
    assert (logits - ref).abs().max().item() < 1e-4


def test_blocks_moved_through_bytes_keep_decoding_exact(case):
    loaded, prompts, refs, _ = case
    runner = _runner(loaded)
    driver = HandDriver(runner)
    seq = driver.add(prompts[4])
    driver.step([seq])  # prefill 300 tokens, sample the first
    blobs = runner.read_blocks(seq.block_table)
    assert all(len(b) == runner.bytes_per_block for b in blobs)
    fresh = [driver.free.pop() for _ in seq.block_table]
    runner.write_blocks(list(zip(fresh, blobs)))
    runner.kv_cache[torch.tensor(seq.block_table)] = 0.0  # the old copy is gone
    seq.block_table[:] = fresh
    driver.run([seq])
    assert seq.output == refs[4]


def test_tied_embeddings_match_hf(tiny_qwen3_tied_dir):
    from transformers import AutoModelForCausalLM

    loaded = load_checkpoint(tiny_qwen3_tied_dir)
    assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen3_tied_dir, local_files_only=True)
    prompt = _prompts(loaded.config.vocab_size)[3]
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt])).logits[0]
    driver = HandDriver(_runner(loaded))
    seq = driver.add(prompt)
    logits = driver.runner.forward_logits(SchedulerOutput([driver._schedule(seq)], len(prompt)))
    assert (logits - ref).abs().max().item() < 1e-4


def test_runner_contract(tiny_qwen3_dir):
    loaded = load_checkpoint(tiny_qwen3_dir)
    runner = ModelRunner(loaded, block_size=BLOCK_SIZE, kv_cache_bytes=64 * 1024,
                         max_num_batched_tokens=64, max_num_seqs=2)
    c = loaded.config
    per_token = c.num_kv_heads * c.head_dim * 4  # fp32 bytes of one layer's K (or V)
    assert runner.bytes_per_block == 2 * c.num_layers * BLOCK_SIZE * per_token
    assert runner.num_blocks == 64 * 1024 // runner.bytes_per_block
    assert runner.kv_cache.shape == (runner.num_blocks, 2, c.num_layers, BLOCK_SIZE,
                                     c.num_kv_heads, c.head_dim)
    assert runner.kv_cache[3].is_contiguous()

    def seq(seq_id, tokens, start, table, sample=True):
        return ScheduledSequence(seq_id, tokens, start, table, sample, GREEDY, tokens, [])

    # only sequences with sample=True return a token, in scheduled order
    out = runner.execute(SchedulerOutput([seq(7, [5] * 20, 0, [1, 2], sample=False),
                                          seq(3, [6, 7, 8], 0, [4])], 23))
    assert out.seq_ids == [3] and len(out.sampled_token_ids) == 1 and out.logprobs == [None]

    with pytest.raises(ValueError, match="sequence 9: 3 tokens from position 15 need 2 blocks"):
        runner.execute(SchedulerOutput([seq(9, [1, 2, 3], 15, [4])], 3))
    with pytest.raises(ValueError, match="max_num_seqs=2"):
        runner.execute(SchedulerOutput([seq(i, [1], 0, [i]) for i in range(3)], 3))
    with pytest.raises(ValueError, match="max_num_batched_tokens=64"):
        runner.execute(SchedulerOutput([seq(1, [1] * 65, 0, [1, 2, 3, 4, 5])], 65))
    with pytest.raises(ValueError, match=f"expected {runner.bytes_per_block}"):
        runner.write_blocks([(1, b"\0" * 10)])
    with pytest.raises(ValueError, match="raise the KV cache budget"):
        ModelRunner(loaded, kv_cache_bytes=100)

    # blocks_to_load land before the forward pass reads them
    blob = runner.read_blocks([4])[0]
    runner.kv_cache[5] = 0.0
    again = runner.forward_logits(SchedulerOutput([seq(3, [9], 3, [5])], 1,
                                                  blocks_to_load=[(5, blob)]))
    direct = runner.forward_logits(SchedulerOutput([seq(3, [9], 3, [4])], 1))
    assert torch.equal(again, direct)
