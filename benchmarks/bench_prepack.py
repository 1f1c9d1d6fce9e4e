"""A/B of the CPU linear paths on whole decode steps: prepacked oneDNN weights (packed for
batch 16, the default, and for batch 1) against torch's reference `linear`.

Three runners over the same `100m` checkpoint decode the same prompts; they take turns run
by run (the order flips each round) so that a neighbour's load falls on all of them, and
each path's median decode step is reported with its ratio to the reference, beside the
CPU description.

    python benchmarks/bench_prepack.py --dtype float32 --batch 16 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.bench_model import BLOCK_SIZE, make_bench
from kernels import linear as dense
from kernels.cpu import describe
from workers.engine.make_model import make_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--new-tokens", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prompt_len = 32
    blocks_per_seq = -(-(prompt_len + args.new_tokens) // BLOCK_SIZE)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(Path(tmp) / "m", arch="qwen3", preset="100m",
                               tie_word_embeddings=True)
        shape = (args.batch, blocks_per_seq, prompt_len)
        default_hint = dense.PACK_BATCH_HINT
        benches = {f"prepacked (hint {default_hint})":
                   make_bench(model_dir, args.dtype, True, *shape)}
        dense.PACK_BATCH_HINT = 1
        benches["prepacked (hint 1)"] = make_bench(model_dir, args.dtype, True, *shape)
        dense.PACK_BATCH_HINT = default_hint
        benches["reference"] = make_bench(model_dir, args.dtype, False, *shape)
        gen = torch.Generator().manual_seed(0)
        prompts = torch.randint(3, 32000, (args.batch, prompt_len), generator=gen).tolist()
        times: dict[str, list[float]] = {name: [] for name in benches}
        for bench in benches.values():
            bench.generate(prompts, 4)  # warm up
        for round_ in range(args.rounds):
            order = list(benches.items())
            for name, bench in order if round_ % 2 == 0 else reversed(order):
                bench.generate(prompts, args.new_tokens, times[name])
    print(describe())
    print(f"100m qwen3, {args.dtype}, batch {args.batch}, decode steps per path: "
          f"{len(times['reference'])}")
    ref = statistics.median(times["reference"])
    for name, values in times.items():
        med = statistics.median(values)
        print(f"  {name:>22}: median {med * 1e3:.1f} ms/step, {med / ref:.2f}x the reference")


if __name__ == "__main__":
    main()
