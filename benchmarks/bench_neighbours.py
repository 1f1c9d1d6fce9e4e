"""How much the engine's steps slow down when the machine's other cores are busy.

    python benchmarks/bench_neighbours.py [--preset small] [--rounds 5] [--num-lines 320]

The service benchmarks (bench_batch.py, bench_pipeline.py) compare the served engine with
the offline engine in the same run. The offline engine runs with the other cores idle;
the served one shares the machine with the web, Postgres, Redis and the database
process, which run on the other cores. This measures what that neighbourhood alone costs
an engine step, with no llmq code on the other cores: the offline engine (same config as
the worker, one torch thread) runs a batch of decode-heavy requests (64 sequences a
step) alone and beside a synthetic load in another process:

* `python`: a Python loop building and dropping dicts of strings (allocations and
  pointer chasing, like a web or database process);
* `python, half the time`: the same, 2 ms on and 2 ms off;
* `memory`: numpy summing a 256 MB array (memory bandwidth);
* `a spinning core`: `while True: pass` (no memory traffic at all: what is left is what
  the two cores share below their caches, such as a hypervisor's SMT siblings or a
  common clock);
* `vector math in L1`: numpy multiplying 48 x 48 fp32 matrices on one thread (the
  vector units busy, the data in the first-level cache: a neighbour on the same physical
  core, as SMT siblings are, takes those units from the engine; one on another core
  does not);
* `8 MB copied`: numpy copying 8 MB to 8 MB (a working set of the order of a small
  model's weights, in the last-level cache the cores share).

Each load is started, given time to settle, and killed after its round; the kinds
alternate within every round, so drift in the machine's speed hits them alike. The
figure is the engine thread's CPU time per step (not wall time: a load that takes the
engine's core away is not what is measured), its median over the rounds, its ratio to
the median with nothing beside it, and the median of its ratios to the same round's
engine alone (a machine whose speed drifts between rounds moves the first ratio more).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench_batch import run_offline  # noqa: E402
from bench_pipeline import load_offline_engine  # noqa: E402

from tasks.settings import Settings  # noqa: E402

LOADS = {
    "nothing": None,
    "python": "d = {}\nwhile True:\n    for i in range(200000):\n        d[i] = str(i)\n"
              "    d.clear()\n",
    "python, half the time": (
        "import time\nd = {}\nwhile True:\n    t = time.perf_counter()\n"
        "    while time.perf_counter() - t < 0.002:\n        for i in range(2000):\n"
        "            d[i] = str(i)\n        d.clear()\n    time.sleep(0.002)\n"),
    "memory": "import numpy as np\nx = np.ones(256_000_000, dtype=np.uint8)\n"
              "while True:\n    x.sum()\n",
    "a spinning core": "while True:\n    pass\n",
    "vector math in L1": (
        "import os\nos.environ['OPENBLAS_NUM_THREADS'] = os.environ['OMP_NUM_THREADS'] = '1'"
        "\nimport numpy as np\na = np.ones((48, 48), np.float32)\nwhile True:\n"
        "    for _ in range(1000):\n        a = np.dot(a, a) * 1e-3 + 1\n"),
    "8 MB copied": "import numpy as np\nx = np.ones(8_000_000, dtype=np.uint8)\n"
                   "y = np.empty_like(x)\nwhile True:\n    np.copyto(y, x)\n",
}
SETTLE_SECONDS = 0.7  # a load's start-up (imports, the array) before the engine runs


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small", help="workers.engine.make_model preset")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--num-lines", type=int, default=320, help="requests a measurement runs")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    p.add_argument("--prompt-words", type=int, default=24)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the engine")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from kernels.cpu import describe
    from workers.engine.make_model import make_model

    model_dir = make_model(Path(tempfile.mkdtemp(prefix="llmq-bench-neighbours-")) / "model",
                           "qwen3", args.preset)
    engine = load_offline_engine(str(model_dir), args, Settings.from_env())
    run_offline(engine, args, "warm-up")
    figures: dict[str, list[float]] = {name: [] for name in LOADS}
    for round_index in range(args.rounds):
        for name, code in LOADS.items():
            load = subprocess.Popen([sys.executable, "-c", code]) if code else None
            try:
                if load is not None:
                    time.sleep(SETTLE_SECONDS)
                figures[name].append(
                    run_offline(engine, args, f"{round_index}-{name}")["cpu_ms_per_step"])
            finally:
                if load is not None:
                    load.kill()
                    load.wait()
        print(f"round {round_index + 1}: " + ", ".join(
            f"{name} {values[-1]:.2f}" for name, values in figures.items()) + " ms",
            flush=True)
    alone = statistics.median(figures["nothing"])
    print(f"\n{describe()}; {args.preset} qwen3, {args.num_lines} requests x "
          f"{args.max_tokens} tokens a measurement, {args.rounds} rounds\n")
    print("| beside the engine | engine CPU per step, median (rounds) | / alone | / alone in "
          "the same round, median (rounds) |")
    print("| --- | --- | --- | --- |")
    for name, values in figures.items():
        median = statistics.median(values)
        within = [v / a for v, a in zip(values, figures["nothing"])]
        print(f"| {name} | {median:.2f} ms ({', '.join(f'{v:.2f}' for v in values)}) | "
              f"{median / alone:.3f}x | {statistics.median(within):.3f}x "
              f"({', '.join(f'{r:.2f}' for r in within)}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
