"""The projections of a whole step at a given row count, with the weights streamed from
memory as a step reads them, and with the same multiplies on weights the caches hold.

Shapes of the `100m` preset (hidden 768, 12 layers, fused QKV 1280, fused gate/up 4096,
down 2048 -> 768, LM head 32000): one pass = every layer's four projections on distinct
weights plus the LM head, as a decode step of that many rows does them. "hot" runs the
same FLOPs on the first layer's weights twelve times, so they stay in the caches. The
paths take turns round by round (the order rotates), medians reported beside the CPU
description; the floor is the weights' bytes over the read bandwidth measured in the run on
`--threads` threads (`bench_model.read_bandwidth`).

A large gap between "streamed" and "hot" at a row count means the GEMM there does not
hide the memory's latency: the weights are read once a pass either way, and at 16 rows
and more the multiplies, not the bytes, should bound a pass.

    python benchmarks/bench_gemm.py --dtype float32 --rows 1,16,64,256
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from bench_model import read_bandwidth  # the floor bench_model uses

from kernels import linear as dense
from kernels import native
from kernels.cpu import describe

HIDDEN, LAYERS, VOCAB = 768, 12, 32000
LAYER_SHAPES = ((HIDDEN, 1280), (HIDDEN, HIDDEN), (HIDDEN, 4096), (2048, HIDDEN))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rows", default="1,16,64,256")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(describe(), flush=True)
    gen = torch.Generator().manual_seed(0)
    shapes = [shape for _ in range(LAYERS) for shape in LAYER_SHAPES] + [(HIDDEN, VOCAB)]
    weights = [(torch.randn(n, k, generator=gen) * 0.02).to(dtype) for k, n in shapes]
    hot = weights[:len(LAYER_SHAPES)] * LAYERS + [weights[-1]]
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    bandwidth = read_bandwidth()
    print(f"{len(weights)} weights, {weight_bytes / 1e6:.0f} MB; read bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s -> a pass reads them in >= "
          f"{weight_bytes / bandwidth * 1e3:.1f} ms", flush=True)
    paths: dict[str, tuple[list, list, int]] = {
        "torch linear": (weights, hot, 0)}
    if all(dense.can_prepack(w) for w in weights):
        packed = [dense.prepack(w) for w in weights]
        paths["oneDNN prepacked"] = (packed, packed[:len(LAYER_SHAPES)] * LAYERS
                                     + [packed[-1]], 0)
    native_ok = native.available() and all(native.supports(w) for w in weights)
    print(f"{'rows':>5} {'path':>17} {'streamed ms':>12} {'hot ms':>8} {'GFLOP/s':>16} "
          f"{'streamed/hot':>12}")
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            flops = sum(2 * rows * k * n for k, n in shapes)
            calls = dict(paths)
            if native_ok and rows <= 16:
                calls["native kernel"] = (weights, hot, rows)
            xs = [torch.randn(rows, w.shape[1], generator=gen).to(dtype) for w in weights]
            names = [(name, mode) for name in calls for mode in ("streamed", "hot")]
            times: dict[tuple[str, str], list[float]] = {key: [] for key in names}
            for round_ in range(args.rounds + 1):
                shift = round_ % len(names)
                for name, mode in names[shift:] + names[:shift]:
                    streamed, warm, skinny_rows = calls[name]
                    ws = streamed if mode == "streamed" else warm
                    start = time.perf_counter()
                    for x, w in zip(xs, ws):
                        dense.linear(x, w, skinny_rows=skinny_rows)
                    if round_:  # the first round warms every path up
                        times[name, mode].append(time.perf_counter() - start)
            for name in calls:
                cold = statistics.median(times[name, "streamed"])
                warm = statistics.median(times[name, "hot"])
                print(f"{rows:>5} {name:>17} {cold * 1e3:>12.2f} {warm * 1e3:>8.2f} "
                      f"{flops / cold / 1e9:>7.0f} / {flops / warm / 1e9:<6.0f} "
                      f"{cold / warm:>12.2f}x", flush=True)


if __name__ == "__main__":
    main()
