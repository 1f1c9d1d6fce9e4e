"""Model execution benchmark on the `100m` preset (random weights, CPU, 2 threads).

Measured in one run, beside the CPU description (model, ISA flags, threads, versions):
1. batch-1 decode milliseconds per step beside the memory-bandwidth floor: the bytes of
   weights one decode step reads, divided by the read bandwidth measured here (a sum over
   a tensor far larger than the caches, the fastest of 1 and 2 threads); also beside the
   copy bandwidth of a large tensor copy (STREAM convention: bytes read + bytes written,
   per second), the convention of earlier figures; for the linear path the runner picks
   at start-up ("ours") and another one (oneDNN prepacked weights, or torch's reference
   `linear` when ours is prepacked or the dtype is never packed here), alternated, medians;
   and each run of ours beside the floor of a read probe taken just before it (a VM's
   bandwidth can change from minute to minute: two vCPUs on two cores read at 51-60
   GB/s, the same two as hyperthreads of one core at 34-36, docs/benchmarks.md);
2. output tokens/s at batch 1, 16 and 64 (same prompt length, same number of new tokens,
   EOS ignored) beside Hugging Face `generate` on the same prompts, same dtype.

    python benchmarks/bench_model.py                       # builds the checkpoint in a temp dir
    python benchmarks/bench_model.py --model-dir DIR --batches 1,16 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from kernels import native
from kernels.cpu import describe
from kernels.linear import describe_times, packs_dtype
from tasks.params import SamplingParams
from workers.engine import huge_pages
from workers.engine.loader import load_checkpoint
from workers.engine.model_runner import ModelRunner
from workers.engine.models.layers import LinearBase, ParallelLMHead
from workers.engine.step_io import ScheduledSequence, SchedulerOutput

BLOCK_SIZE = 16


def _allocators() -> list[Callable[[int, torch.dtype], torch.Tensor]]:
    """Ways to make a tensor of ones: torch's own memory and, where the kernel gives them,
    huge pages (the memory the engine keeps its weights in, workers/engine/huge_pages.py).
    The bandwidths below count the faster, so the floor is the machine's best read rate;
    each makes its buffers only while it is timed."""
    makers: list[Callable[[int, torch.dtype], torch.Tensor]] = [
        lambda numel, dtype: torch.ones(numel, dtype=dtype)]
    if huge_pages.available():
        makers.append(lambda numel, dtype: huge_pages.zeros((numel,), dtype).fill_(1))
    return makers


def copy_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Best bytes/s of `dst.copy_(src)` over a tensor far larger than the caches."""
    best = float("inf")
    numel = num_bytes // 4
    for make in _allocators():
        src, dst = make(numel, torch.float32), make(numel, torch.float32)
        for _ in range(repeats):
            t = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t)
        del src, dst
    return 2 * num_bytes / best


def read_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Best bytes/s of summing a tensor far larger than the caches, on this many threads (a
    sum reads each byte once and writes nothing), in bf16 and in fp32: the faster counts,
    since without native bf16 (an AVX2 CPU) the bf16 sum is bound by its conversions, not
    by memory."""
    best = float("inf")
    for dtype in (torch.bfloat16, torch.float32):
        for make in _allocators():
            src = make(num_bytes // dtype.itemsize, dtype)
            for _ in range(repeats):
                t = time.perf_counter()
                src.sum()
                best = min(best, time.perf_counter() - t)
            del src
    return num_bytes / best


def read_bandwidth_on(threads: int) -> float:
    """`read_bandwidth` on this many torch threads (left set)."""
    torch.set_num_threads(threads)
    return read_bandwidth()


def step_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights a decode step reads: each projection's weight once, whichever
    copy its calls take (plain, prepacked or panels: one size), and the norms; the input
    embedding reads one row a token (tied, the LM head reads the table as a projection)."""
    projections = [m for m in model.modules() if isinstance(m, LinearBase | ParallelLMHead)]
    total = sum(m.weight.numel() * m.weight.element_size() for m in projections)
    seen = {id(m.weight) for m in projections}
    for name, p in model.named_parameters():
        if id(p) not in seen and not name.endswith("embed_tokens.weight"):
            total += p.numel() * p.element_size()
    return total


class Bench:
    """Drives the runner the way the engine does: one step = one SchedulerOutput."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.params = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)

    def generate(self, prompts: list[list[int]], num_new: int,
                 step_times: list[float] | None = None) -> list[list[int]]:
        max_len = len(prompts[0]) + num_new
        blocks_per_seq = -(-max_len // BLOCK_SIZE)
        tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
                  for i in range(len(prompts))]
        outputs: list[list[int]] = [[] for _ in prompts]
        computed = [0] * len(prompts)
        while len(outputs[0]) < num_new:
            scheduled = []
            for i, prompt in enumerate(prompts):
                tokens = prompt + outputs[i]
                scheduled.append(ScheduledSequence(
                    seq_id=i, token_ids=tokens[computed[i]:], start_pos=computed[i],
                    block_table=tables[i], sample=True, params=self.params,
                    prompt_token_ids=prompt, output_token_ids=outputs[i]))
            out = SchedulerOutput(scheduled, sum(len(s.token_ids) for s in scheduled))
            t = time.perf_counter()
            result = self.runner.execute(out)
            if step_times is not None and computed[0] >= len(prompts[0]):
                step_times.append(time.perf_counter() - t)
            for i, token in zip(result.seq_ids, result.sampled_token_ids):
                computed[i] += len(scheduled[i].token_ids)
                outputs[i].append(token)
        return outputs


def hf_generate(hf, prompts: list[list[int]], num_new: int) -> list[list[int]]:
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=num_new, min_new_tokens=num_new, eos_token_id=None,
                          pad_token_id=0)
    return out[:, ids.shape[1]:].tolist()


def median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def make_bench(model_dir: str, dtype: str, linear_path: str | None, max_batch: int,
               blocks_per_seq: int, prompt_len: int) -> Bench:
    loaded = load_checkpoint(model_dir, dtype=dtype)
    probe = ModelRunner(loaded, block_size=BLOCK_SIZE, kv_cache_bytes=1 << 20,
                        linear_path="reference")
    runner = ModelRunner(loaded, block_size=BLOCK_SIZE,
                         kv_cache_bytes=probe.bytes_per_block * blocks_per_seq * max_batch,
                         max_num_batched_tokens=max_batch * prompt_len,
                         max_num_seqs=max_batch, linear_path=linear_path)
    return Bench(runner)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", help="reuse a checkpoint instead of building 100m")
    parser.add_argument("--arch", default="qwen3")
    parser.add_argument("--dtype", default="auto", help="auto (this CPU's default), float32, "
                        "bfloat16")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3,
                        help="alternated runs per figure; medians (and best) reported")
    parser.add_argument("--no-reference", action="store_true",
                        help="skip the linear path the runner did not pick (the A/B)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]

    tmp = None
    model_dir = args.model_dir
    if model_dir is None:
        from workers.engine.make_model import make_model

        tmp = tempfile.TemporaryDirectory()
        print(f"building the 100m {args.arch} checkpoint in {tmp.name} ...", flush=True)
        model_dir = make_model(Path(tmp.name) / "m", arch=args.arch, preset="100m",
                               tie_word_embeddings=True)
    max_batch = max(batches)
    blocks_per_seq = -(-(args.prompt_len + args.new_tokens) // BLOCK_SIZE)
    shape = (max_batch, blocks_per_seq, args.prompt_len)
    # "ours" takes the linear path the runner picks at start-up; the other path runs
    # beside it as the A/B
    benches = {"ours": make_bench(model_dir, args.dtype, None, *shape)}
    runner = benches["ours"].runner
    # (where this dtype's weights are never packed, bf16 on a CPU without bf16 dot
    # products, "prepacked" would run torch's linear under the wrong name)
    packs = packs_dtype(runner.dtype)
    other = "reference" if runner.linear_path == "prepacked" or not packs else "prepacked"
    if not args.no_reference:
        benches[other] = make_bench(model_dir, args.dtype, other, *shape)
    loaded = runner.loaded
    config = loaded.config
    num_params = sum(p.numel() for p in loaded.model.parameters()) + sum(
        b.numel() for b in loaded.model.buffers() if b.is_mkldnn)
    gen = torch.Generator().manual_seed(0)
    all_prompts = torch.randint(3, config.vocab_size, (max_batch, args.prompt_len),
                                generator=gen).tolist()

    bandwidth = copy_bandwidth()
    reads = {}
    for threads in sorted({args.threads, 1}):
        reads[threads] = read_bandwidth_on(threads)
    torch.set_num_threads(args.threads)
    read = max(reads.values())
    weight_bytes = step_weight_bytes(loaded.model)
    floor_ms = weight_bytes / read * 1e3
    copy_floor_ms = weight_bytes / bandwidth * 1e3
    print(describe())
    print(f"model: {config.arch} {num_params / 1e6:.1f}M params, {config.dtype}; "
          f"prompt {args.prompt_len}, {args.new_tokens} new tokens")
    probe = describe_times(runner.linear_probe)
    plain = ("" if runner.plain_rows is None
             else f", plain weights up to {runner.plain_rows} rows")
    panels = f" on fp32 panels ({runner.panel_weights} weights)" if runner.panel_weights else ""
    print(f"linear path chosen at start-up: {runner.linear_path}, native kernel up to "
          f"{runner.skinny_rows} rows{panels}{plain} (ms per pass over the model's weights: "
          f"{probe or 'not measured'})")
    weighed = ", ".join(f"{rows} rows {t['plan'] * 1e3:.2f} / {t['decoder'] * 1e3:.2f}"
                        for rows, t in runner.decoder_probe.items())
    print(f"native decoder (every layer in one call): decode steps of up to "
          f"{runner.decoder_rows} rows" + (
              f" (ms per step timed at start-up, the plan's paths / with the decoder: "
              f"{weighed})" if weighed else ""))
    if runner.row_prefetch_probe:
        print(f"native kernel's one-row stream prefetches {runner.row_prefetch} bytes ahead "
              f"(ms per one-row pass timed at start-up, by distance: " + ", ".join(
                  f"{n} {t * 1e3:.2f}" for n, t in runner.row_prefetch_probe.items()) + ")")
    if runner.panel_prefetch_probe:
        def panel_prefetch(choice: int | None) -> str:
            return ("the next panel" if choice == native.NEXT_PANEL else "nothing"
                    if choice == 0 else f"{choice} bytes ahead")

        print(f"one-row calls on fp32 panels prefetch {panel_prefetch(runner.panel_row_prefetch)}"
              " (ms per one-row pass timed at start-up: " + ", ".join(
                  f"{panel_prefetch(n)} {t * 1e3:.2f}"
                  for n, t in runner.panel_prefetch_probe.items()) + ")")
    if runner.panel_streams_probe:
        print(f"calls of up to {native.PANEL_STREAM_ROWS} rows on fp32 panels read "
              f"{runner.panel_row_streams} panel(s) at once (ms per one-row pass timed at "
              "start-up, by panels at once: " + ", ".join(
                  f"{n} {t * 1e3:.2f}" for n, t in runner.panel_streams_probe.items()) + ")")
    if runner.row_streams_probe:
        print(f"one-row calls on bf16 weights read {runner.row_streams} weight row(s) at once "
              "(ms per one-row pass timed at start-up, by rows at once: " + ", ".join(
                  f"{n} {t * 1e3:.2f}" for n, t in runner.row_streams_probe.items()) + ")")
    print(f"weights in transparent huge pages: {runner.huge_page_bytes / 1e6:.0f} MB "
          f"({huge_pages.SETTING_ENV}={huge_pages.setting()}, the kernel's mode "
          f"{huge_pages.thp_mode() or 'unknown'}; the bandwidths below count the faster of "
          f"torch's memory and huge pages)")
    print("read bandwidth " + ", ".join(f"{reads[t] / 1e9:.2f} GB/s on {t} thread(s)"
                                         for t in reads)
          + f"; copy bandwidth {bandwidth / 1e9:.2f} GB/s (read+write)")
    print(f"a decode step reads {weight_bytes / 1e6:.0f} MB of weights -> floor "
          f"{floor_ms:.1f} ms/step at the read bandwidth ({copy_floor_ms:.1f} ms at the copy "
          f"bandwidth)")

    for bench in benches.values():
        bench.generate(all_prompts[:1], 8)  # warm up
    for threads in sorted({args.threads, 1}, reverse=True):
        torch.set_num_threads(threads)
        step_times: dict[str, list[float]] = {name: [] for name in benches}
        # NOTE: alternate the paths run by run: on a shared machine a single run measures
        # the neighbours as much as the code
        # (floor ms, ours' median ms/step) per run, the floor from a read probe just before
        minute_floors: list[tuple[float, float]] = []
        for _ in range(args.repeats):
            if threads == args.threads:
                probe = max(read_bandwidth_on(t) for t in sorted({threads, 1}))
                torch.set_num_threads(threads)
                first = len(step_times["ours"])
            for name, bench in benches.items():
                bench.generate(all_prompts[:1], args.new_tokens, step_times[name])
            if threads == args.threads:
                minute_floors.append((weight_bytes / probe * 1e3,
                                      median(step_times["ours"][first:]) * 1e3))
        for name, times in step_times.items():
            med, best = median(times) * 1e3, min(times) * 1e3
            print(f"batch-1 decode, {threads} thread(s), {name}: median {med:.1f} ms/step "
                  f"({med / floor_ms:.2f}x the floor; {med / copy_floor_ms:.2f}x the copy "
                  f"floor), best {best:.1f} ms/step ({best / floor_ms:.2f}x)", flush=True)
        if minute_floors:
            ratios = [step / floor for floor, step in minute_floors]
            print("  the same minute's floor (a read probe just before each run; this "
                  "machine's bandwidth can change between minutes): ours " + ", ".join(
                      f"{step:.1f} ms against {floor:.1f} ({step / floor:.2f}x)"
                      for floor, step in minute_floors)
                  + f"; median {median(ratios):.2f}x", flush=True)
        if other in step_times:
            print(f"  ours ({runner.linear_path}) / {other} median: "
                  f"{median(step_times['ours']) / median(step_times[other]):.2f}")
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True,
                                              dtype=config.dtype).eval()
    hf_generate(hf, all_prompts[:1], 4)  # warm up
    names = list(benches)
    header = " ".join(f"{name + ' tok/s':>16}" for name in names)
    print(f"{'batch':>5} {header} {'HF tok/s':>9} {'ratio (median)':>15} {'same tokens':>12}")
    for batch in batches:
        prompts = all_prompts[:batch]
        seconds: dict[str, list[float]] = {name: [] for name in [*names, "hf"]}
        outputs: dict[str, list[list[int]]] = {}
        for _ in range(args.repeats):
            for name, bench in benches.items():
                t = time.perf_counter()
                outputs[name] = bench.generate(prompts, args.new_tokens)
                seconds[name].append(time.perf_counter() - t)
            t = time.perf_counter()
            ref = hf_generate(hf, prompts, args.new_tokens)
            seconds["hf"].append(time.perf_counter() - t)
        tps = {name: batch * args.new_tokens / median(v) for name, v in seconds.items()}
        same = sum(a == b for a, b in zip(outputs[names[0]], ref))
        cols = " ".join(f"{tps[name]:>16.1f}" for name in names)
        print(f"{batch:>5} {cols} {tps['hf']:>9.1f} {tps[names[0]] / tps['hf']:>14.2f}x "
              f"{same:>6}/{batch}", flush=True)
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
