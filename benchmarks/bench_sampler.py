"""Sampler benchmark: milliseconds per step for a batch of 64 rows over a 32k vocabulary.

The rows mix the sampling settings a service sees at once: greedy, temperature + top-p,
top-k, min-p, repetition / presence / frequency penalties over a few hundred prompt and
output tokens, seeded rows, min_tokens and logprobs. Reports the best and the median of
many steps (each step is the whole `sample` call: metadata from the rows, penalties,
masks, filters, draws and logprobs), single-threaded and with every intra-op thread.

    python benchmarks/bench_sampler.py
    python benchmarks/bench_sampler.py --rows 64 --vocab 32000 --steps 200
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from tasks.params import SamplingParams
from workers.engine.sampler import sample
from workers.engine.step_io import ScheduledSequence

MIXED_PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, top_p=0.9),
    SamplingParams(temperature=1.0, top_k=40),
    SamplingParams(temperature=0.7, top_k=50, top_p=0.95, seed=11),
    SamplingParams(temperature=1.0, min_p=0.05, seed=12),
    SamplingParams(temperature=0.0, repetition_penalty=1.2),
    SamplingParams(temperature=0.9, presence_penalty=0.5, frequency_penalty=0.3, seed=13),
    SamplingParams(temperature=1.0, top_p=0.8, min_tokens=8, stop_token_ids=[7],
                   logprobs=5),
]


def make_rows(num_rows: int, vocab: int, seed: int = 0) -> list[ScheduledSequence]:
    """`num_rows` sequences cycling through MIXED_PARAMS, with 200-token prompts and up to
    100 output tokens drawn at random from the vocabulary."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(num_rows):
        prompt = torch.randint(0, vocab, (200,), generator=g).tolist()
        output = torch.randint(0, vocab, (i * 7 % 100,), generator=g).tolist()
        seqs.append(ScheduledSequence(
            seq_id=i, token_ids=[(prompt + output)[-1]],
            start_pos=len(prompt) + len(output) - 1, block_table=[0], sample=True,
            params=MIXED_PARAMS[i % len(MIXED_PARAMS)], prompt_token_ids=prompt,
            output_token_ids=output,
        ))
    return seqs


def time_steps(logits: torch.Tensor, seqs: list[ScheduledSequence],
               steps: int) -> tuple[float, float]:
    """(best, median) seconds of one `sample` call."""
    for _ in range(5):
        sample(logits, seqs, eos_token_ids=[2])
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        sample(logits, seqs, eos_token_ids=[2])
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()

    logits = torch.randn(args.rows, args.vocab, generator=torch.Generator().manual_seed(1)) * 4
    seqs = make_rows(args.rows, args.vocab)
    cases = {
        "mixed": seqs,
        "all greedy": [ScheduledSequence(s.seq_id, s.token_ids, s.start_pos, s.block_table,
                                         True, SamplingParams(temperature=0.0),
                                         s.prompt_token_ids, s.output_token_ids)
                       for s in seqs],
    }
    max_threads = torch.get_num_threads()
    for threads in sorted({1, max_threads}):
        torch.set_num_threads(threads)
        for name, rows in cases.items():
            best, median = time_steps(logits, rows, args.steps)
            print(f"{name:>10} rows={args.rows} vocab={args.vocab} threads={threads}: "
                  f"best {best * 1e3:.3f} ms, median {median * 1e3:.3f} ms per step")
    torch.set_num_threads(max_threads)


if __name__ == "__main__":
    main()
