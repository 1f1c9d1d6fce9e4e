"""Tensor-parallel step input: bytes rank 0 pickles to each rank per step, and step time.

1. Bytes (no model): the real scheduler and KV manager with a fake runner, 32 sequences
   of 512-token prompts decoding. For every decode step, the pickled size of the whole
   step (`SchedulerOutput` without token histories, as the driver sent it before deltas)
   beside the pickled size of the `RunStep` delta the driver sends now, and the time rank 0
   spends building and pickling each, and a rank unpickling (and decoding) each.
2. Step time: an `LLM` with `tensor_parallel_size=2` on the `tiny` preset (CPU, gloo),
   the same 32 x 512 workload, 64 new tokens each; median and fastest wall time of
   `runner.execute` over the steps that are decodes only (on a shared host the fastest
   step is the steadier figure).

    python benchmarks/bench_tp_step.py                  # both parts
    python benchmarks/bench_tp_step.py --part bytes
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvcache.kv_cache_manager import KVCacheManager
from tasks.params import SamplingParams
from workers.engine.scheduler import Scheduler
from workers.engine.sequence import Sequence
from workers.engine.step_io import ModelRunnerOutput, SchedulerOutput

NUM_SEQS = 32
PROMPT_LEN = 512
NUM_NEW_TOKENS = 64


def _pickled_size(message: object) -> int:
    # what Connection.send does: ForkingPickler, the default protocol
    return len(ForkingPickler.dumps(message))


def bench_bytes(prompt_len: int = PROMPT_LEN,
                num_steps: int = NUM_NEW_TOKENS) -> dict[str, float]:
    from workers.engine.parallel.messages import RunStep
    from workers.engine.parallel.step_delta import StepDecoder, StepEncoder

    block_size = 16
    kv = KVCacheManager(NUM_SEQS * ((prompt_len + num_steps) // block_size + 2), block_size)
    sched = Scheduler(kv, max_num_seqs=NUM_SEQS, max_num_batched_tokens=max(8192, prompt_len),
                      max_model_len=prompt_len + num_steps + 16, eos_token_ids=[0])
    rng = random.Random(0)
    for i in range(NUM_SEQS):
        prompt = [rng.randrange(1, 30000) for _ in range(prompt_len)]
        # one params object per request, as the service builds them
        params = SamplingParams(max_tokens=num_steps, ignore_eos=True)
        sched.add_seqs([Sequence(i, f"r{i}", 0, prompt, params, 0, i)])
    encoder, decoder = StepEncoder(), StepDecoder()
    full: list[int] = []
    delta: list[int] = []
    # microseconds per decode step: rank 0 building and pickling the message, a rank
    # unpickling it (and decoding the delta), before and now
    send_before: list[float] = []
    recv_before: list[float] = []
    send_now: list[float] = []
    recv_now: list[float] = []
    while sched.has_unfinished_seqs():
        out = sched.schedule()
        decodes_only = out.num_batched_tokens == len(out.scheduled)
        started = time.perf_counter()
        slim = [replace(s, prompt_token_ids=[], output_token_ids=[]) for s in out.scheduled]
        blob_before = ForkingPickler.dumps(replace(out, scheduled=slim))
        mid = time.perf_counter()
        ForkingPickler.loads(blob_before)
        done = time.perf_counter()
        if decodes_only:
            send_before.append((mid - started) * 1e6)
            recv_before.append((done - mid) * 1e6)
        started = time.perf_counter()
        blob_now = ForkingPickler.dumps(RunStep(encoder.encode(out), out.blocks_to_load))
        mid = time.perf_counter()
        message = ForkingPickler.loads(blob_now)
        decoder.decode(message.delta, message.blocks_to_load)
        done = time.perf_counter()
        if decodes_only:
            send_now.append((mid - started) * 1e6)
            recv_now.append((done - mid) * 1e6)
            full.append(len(blob_before))
            delta.append(len(blob_now))
        ids = [s.seq_id for s in out.scheduled if s.sample]
        sched.update_from_output(out, ModelRunnerOutput(
            ids, [(i * 31 + 7) % 30000 + 1 for i in ids], [None] * len(ids)))
    median = statistics.median
    return {"decode_steps": len(full), "full_bytes": median(full),
            "delta_bytes": median(delta), "send_before_us": median(send_before),
            "recv_before_us": median(recv_before), "send_now_us": median(send_now),
            "recv_now_us": median(recv_now)}


def bench_step_time(repeats: int = 1) -> dict[str, float]:
    from workers.engine.llm import LLM
    from workers.engine.make_model import make_model

    rng = random.Random(0)
    prompts = [[rng.randrange(1, 1000) for _ in range(PROMPT_LEN)] for _ in range(NUM_SEQS)]
    params = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    decode_ms: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(Path(tmp), preset="tiny", seed=0, dtype="float32", arch="qwen3")
        with LLM(str(model_dir), dtype="float32", tensor_parallel_size=2,
                 max_num_seqs=NUM_SEQS, kv_cache_bytes=64 << 20) as llm:
            runner = llm.engine.runner
            execute = runner.execute

            def timed(out: SchedulerOutput) -> ModelRunnerOutput:
                started = time.perf_counter()
                result = execute(out)
                if out.num_batched_tokens == len(out.scheduled):
                    decode_ms.append((time.perf_counter() - started) * 1e3)
                return result

            runner.execute = timed  # type: ignore[method-assign]
            for _ in range(repeats):
                llm.generate(prompts, params)
    return {"decode_steps": len(decode_ms), "median_ms": statistics.median(decode_ms),
            "min_ms": min(decode_ms)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["bytes", "time", "all"], default="all")
    parser.add_argument("--prompt-len", type=int, default=PROMPT_LEN)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.part in ("bytes", "all"):
        figures = bench_bytes(args.prompt_len)
        print(f"bytes per decode step to each rank ({NUM_SEQS} seqs x {args.prompt_len}-token "
              f"prompts, {figures['decode_steps']} steps, median): whole step "
              f"{figures['full_bytes']:.0f} B, delta {figures['delta_bytes']:.0f} B "
              f"({figures['full_bytes'] / figures['delta_bytes']:.1f}x less)")
        print(f"  rank 0 build + pickle: whole step {figures['send_before_us']:.0f} us, "
              f"delta {figures['send_now_us']:.0f} us; rank unpickle (+ decode): whole "
              f"step {figures['recv_before_us']:.0f} us, delta {figures['recv_now_us']:.0f} us")
    if args.part in ("time", "all"):
        figures = bench_step_time(args.repeats)
        print(f"TP=2 CPU decode step ({NUM_SEQS} seqs, tiny preset, "
              f"{figures['decode_steps']} steps): median {figures['median_ms']:.2f} ms, "
              f"fastest {figures['min_ms']:.2f} ms")


if __name__ == "__main__":
    main()
