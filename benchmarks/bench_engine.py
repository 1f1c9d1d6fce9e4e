"""Continuous-batching benchmarks.

1. Scheduler overhead: `schedule()` + `update_from_output()` per step with a fake runner
   (no model), 256 sequences running. Target: <= 1 ms per step.
2. Engine throughput on the `100m` preset (random weights, CPU, `--dtype` float32 or
   bfloat16 on both sides; the CPU description is printed first): a mixed workload
   of 64 requests (prompts 32-512 tokens, outputs 16-256, fixed seed, ignore_eos), beside
   Hugging Face `generate` on the same requests one by one and in padded static batches of
   16. Targets: >= 8x one by one, >= 2x static batching.

    python benchmarks/bench_engine.py                 # both parts
    python benchmarks/bench_engine.py --part scheduler
    python benchmarks/bench_engine.py --part engine --hf-one-by-one-subset 16

Greedy outputs of all three are compared on the requests they share (a sanity check
that the figures measure the same work).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvcache.kv_cache_manager import KVCacheManager
from tasks.params import SamplingParams
from workers.engine.scheduler import Scheduler
from workers.engine.sequence import Sequence
from workers.engine.step_io import ModelRunnerOutput, SchedulerOutput

# ---- 1. scheduler overhead -----------------------------------------------------------


def bench_scheduler(num_seqs: int = 256, prompt_len: int = 128, num_steps: int = 500) -> float:
    """Mean milliseconds of schedule + update per decode step with `num_seqs` running."""
    block_size = 16
    max_len = prompt_len + num_steps + 64
    kv = KVCacheManager(num_seqs * (max_len // block_size + 2), block_size)
    sched = Scheduler(
        kv,
        max_num_seqs=num_seqs,
        max_num_batched_tokens=8192,
        max_model_len=max_len,
        eos_token_ids=[0],
    )
    rng = random.Random(0)
    params = SamplingParams(max_tokens=num_steps + 32, ignore_eos=True)
    for i in range(num_seqs):
        prompt = [rng.randrange(1, 30000) for _ in range(prompt_len)]
        sched.add_seqs([Sequence(i, f"r{i}", 0, prompt, params, 0, i)])

    def fake_execute(out: SchedulerOutput) -> ModelRunnerOutput:
        ids = [s.seq_id for s in out.scheduled if s.sample]
        return ModelRunnerOutput(ids, [(i * 31 + 7) % 30000 + 1 for i in ids], [None] * len(ids))

    while sched.num_running < num_seqs or any(
        s.num_computed_tokens < s.num_tokens - 1 for s in sched.running
    ):  # prefill everything first: measure steady-state decode steps
        out = sched.schedule()
        sched.update_from_output(out, fake_execute(out))
    times = []
    for _ in range(num_steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        runner_out = fake_execute(out)  # not timed: stands for the model
        t2 = time.perf_counter()
        sched.update_from_output(out, runner_out)
        t3 = time.perf_counter()
        assert len(out.scheduled) == num_seqs
        times.append((t1 - t0) + (t3 - t2))
    return statistics.mean(times) * 1000


# ---- 2. engine vs Hugging Face -------------------------------------------------------


@dataclass(slots=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(num_requests: int, vocab_size: int, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(10, vocab_size) for _ in range(rng.randint(32, 512))]
        for _ in range(num_requests)
    ]
    return Workload(prompts, [rng.randint(16, 256) for _ in range(num_requests)])


def run_engine(model_dir: Path, work: Workload, kv_cache_bytes: int,
               dtype: str) -> tuple[float, list]:
    from workers.engine.builder import build_engine
    from workers.engine.config import EngineConfig

    engine = build_engine(
        str(model_dir), dtype=dtype, kv_cache_bytes=kv_cache_bytes, config=EngineConfig()
    )
    # warm up the kernels once, outside the timing
    engine.add_request("warmup", work.prompts[0][:32], SamplingParams(max_tokens=2, temperature=0))
    while engine.has_unfinished_requests():
        engine.step()
    outputs: dict[str, list[int]] = {str(i): [] for i in range(len(work.prompts))}
    t0 = time.perf_counter()
    for i, (prompt, out_len) in enumerate(zip(work.prompts, work.output_lens)):
        params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
        engine.add_request(str(i), prompt, params)
    while engine.has_unfinished_requests():
        for delta in engine.step():
            outputs[delta.request_id].extend(delta.new_token_ids)
    elapsed = time.perf_counter() - t0
    stats = engine.stats()
    print(
        f"  engine: {stats.num_steps} steps, {stats.num_preemptions} preemptions, "
        f"{engine.num_blocks} KV blocks",
        flush=True,
    )
    return elapsed, [outputs[str(i)] for i in range(len(work.prompts))]


def run_hf(model, work: Workload, indices: list[int], batch_size: int) -> tuple[float, list]:
    """Greedy HF generate over `indices`, in left-padded static batches of `batch_size`."""
    import torch

    outputs: list[list[int]] = []
    t0 = time.perf_counter()
    for start in range(0, len(indices), batch_size):
        batch = indices[start : start + batch_size]
        max_len = max(len(work.prompts[i]) for i in batch)
        ids = torch.zeros((len(batch), max_len), dtype=torch.long)
        mask = torch.zeros((len(batch), max_len), dtype=torch.long)
        for row, i in enumerate(batch):
            prompt = work.prompts[i]
            ids[row, max_len - len(prompt) :] = torch.tensor(prompt)
            mask[row, max_len - len(prompt) :] = 1
        # static batching runs until the longest output of the batch is done
        new_tokens = max(work.output_lens[i] for i in batch)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        for row, i in enumerate(batch):
            outputs.append(out[row, max_len : max_len + work.output_lens[i]].tolist())
    return time.perf_counter() - t0, outputs


def bench_engine(args: argparse.Namespace) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM

    from kernels.cpu import describe
    from workers.engine.make_model import make_model

    torch.set_num_threads(args.threads)
    print(describe(), flush=True)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        make_model(model_dir, "qwen3", args.preset, seed=args.seed, dtype="float32")
        model = AutoModelForCausalLM.from_pretrained(model_dir,
                                                     dtype=getattr(torch, args.dtype))
        model.eval()
        work = make_workload(args.num_requests, model.config.vocab_size, seed=args.seed)
        print(
            f"workload: {len(work.prompts)} requests, "
            f"{sum(map(len, work.prompts))} prompt tokens, {work.num_output_tokens} output tokens"
            f", {args.dtype}",
            flush=True,
        )

        engine_s, engine_out = run_engine(model_dir, work, args.kv_cache_bytes, args.dtype)
        engine_tps = work.num_output_tokens / engine_s
        print(f"  engine: {engine_s:.1f}s, {engine_tps:.1f} output tok/s", flush=True)

        all_idx = list(range(len(work.prompts)))
        static_idx = all_idx[: args.hf_static_subset or len(all_idx)]
        static_s, static_out = run_hf(model, work, static_idx, batch_size=16)
        static_tokens = sum(work.output_lens[i] for i in static_idx)
        static_tps = static_tokens / static_s
        print(
            f"  HF static batches of 16 ({len(static_idx)} of {len(all_idx)} requests, "
            f"{static_tokens} tokens): {static_s:.1f}s, {static_tps:.1f} tok/s",
            flush=True,
        )

        subset = all_idx[: args.hf_one_by_one_subset or len(all_idx)]
        one_s, one_out = run_hf(model, work, subset, batch_size=1)
        one_tokens = sum(work.output_lens[i] for i in subset)
        one_tps = one_tokens / one_s
        print(
            f"  HF one by one ({len(subset)} of {len(all_idx)} requests, {one_tokens} tokens): "
            f"{one_s:.1f}s, {one_tps:.1f} tok/s",
            flush=True,
        )
        same_one = sum(engine_out[i] == one_out[k] for k, i in enumerate(subset))
        same_static = sum(engine_out[i] == static_out[k] for k, i in enumerate(static_idx))
        print(
            f"  greedy agreement: engine == HF one-by-one on {same_one}/{len(subset)}, "
            f"engine == HF static on {same_static}/{len(static_idx)}",
            flush=True,
        )
    return {
        "engine_tps": engine_tps,
        "static_tps": static_tps,
        "one_tps": one_tps,
        "vs_one": engine_tps / one_tps,
        "vs_static": engine_tps / static_tps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["all", "scheduler", "engine"], default="all")
    parser.add_argument("--preset", default="100m")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="weights of the engine and of Hugging Face alike")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--kv-cache-bytes", type=int, default=2 * 1024**3)
    parser.add_argument(
        "--hf-one-by-one-subset",
        type=int,
        default=0,
        help="run HF one by one on only the first N requests (0: all), tokens/s scales",
    )
    parser.add_argument(
        "--hf-static-subset",
        type=int,
        default=0,
        help="run HF static batching on only the first N requests (0: all; whole batches)",
    )
    args = parser.parse_args()
    if args.part in ("all", "scheduler"):
        ms = bench_scheduler()
        print(f"scheduler: {ms:.3f} ms per step (schedule + update) at 256 running sequences")
    if args.part in ("all", "engine"):
        r = bench_engine(args)
        print(
            f"engine {r['engine_tps']:.1f} tok/s = {r['vs_one']:.1f}x HF one-by-one "
            f"({r['one_tps']:.1f}), {r['vs_static']:.2f}x HF static batch 16 "
            f"({r['static_tps']:.1f})"
        )


if __name__ == "__main__":
    main()
