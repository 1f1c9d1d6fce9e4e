"""Micro-benchmark of decode attention formulations over the block-major KV cache.

Shapes of the `100m` preset by default: 12 layers, 12 query heads over 4 KV heads, head_dim
64, block size 16, fp32 (`--heads`, `--kv-heads`, `--head-dim`, `--dtype` for others). The
native kernel (kernels/native/step_ops.c, the CPU's default) runs beside the torch
formulations. One call = one layer's decode attention (the model makes 12 per step), on a
per-layer strided view `kv_cache[:, 0, layer]` like the model's.
Contexts are drawn uniformly from 32-768 tokens; block tables are random so no sequence's
blocks are adjacent. Each formulation is checked against the padded reference before it
is timed.

    python benchmarks/bench_attention.py                      # batches 1, 16, 64
    python benchmarks/bench_attention.py --batches 64 --repeats 20 --threads 1
    # the `small` preset's shapes in bf16, the native kernel alone
    python benchmarks/bench_attention.py --heads 8 --kv-heads 2 --head-dim 32 \
        --dtype bfloat16 --native-only
"""

from __future__ import annotations

import argparse
import functools
import random
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F

from kernels import native
from kernels.attention import build_attention_metadata, paged_attention
from kernels.cpu import describe

NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 12, 12, 4, 64, 16


def padded(q, k_cache, v_cache, tables: list[list[int]], lens: list[int]) -> torch.Tensor:
    """The former formulation: every context copied out, padded to the longest table,
    one masked attention call."""
    num_decodes = q.shape[0]
    max_blocks = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables])
    keys = torch.arange(max_blocks * BLOCK_SIZE)
    mask = (keys[None, :] < torch.tensor(lens)[:, None])[:, None, None, :]
    qh = q.view(num_decodes, NUM_KV_HEADS, NUM_HEADS // NUM_KV_HEADS, HEAD_DIM)
    kc = k_cache[bt].flatten(1, 2).transpose(1, 2)
    vc = v_cache[bt].flatten(1, 2).transpose(1, 2)
    return F.scaled_dot_product_attention(qh, kc, vc, attn_mask=mask).flatten(1)


def per_sequence(q, k_cache, v_cache, tables: list[list[int]], lens: list[int]):
    """One small gather and one unmasked attention call per sequence (exact length)."""
    groups = NUM_HEADS // NUM_KV_HEADS
    outs = []
    for i, (table, n) in enumerate(zip(tables, lens)):
        bt = torch.tensor(table)
        kc = k_cache[bt].flatten(0, 1)[:n].transpose(0, 1)
        vc = v_cache[bt].flatten(0, 1)[:n].transpose(0, 1)
        qh = q[i].view(NUM_KV_HEADS, groups, HEAD_DIM)
        outs.append(F.scaled_dot_product_attention(qh, kc, vc).flatten())
    return torch.stack(outs)


def flat_then_slices(q, k_cache, v_cache, tables: list[list[int]], lens: list[int]):
    """One unpadded gather of every real block, then attention on per-sequence slices.
    (With matmul/softmax/matmul instead of SDPA, this was the kernel's previous form.)"""
    groups = NUM_HEADS // NUM_KV_HEADS
    ids = torch.tensor([b for t in tables for b in t])
    kf = k_cache.index_select(0, ids).flatten(0, 1).transpose(0, 1)
    vf = v_cache.index_select(0, ids).flatten(0, 1).transpose(0, 1)
    outs = []
    start = 0
    for i, (table, n) in enumerate(zip(tables, lens)):
        qh = q[i].view(NUM_KV_HEADS, groups, HEAD_DIM)
        outs.append(F.scaled_dot_product_attention(
            qh, kf[:, start:start + n], vf[:, start:start + n]).flatten())
        start += len(table) * BLOCK_SIZE
    return torch.stack(outs)


def segment_softmax(q, k_cache, v_cache, tables: list[list[int]], lens: list[int]):
    """Fully vectorized, no Python loop: one unpadded gather, scores per block with one
    batched matmul, a softmax over each sequence's segment of blocks (index_reduce /
    index_add), one batched matmul with V, summed per sequence."""
    batch, groups = q.shape[0], NUM_HEADS // NUM_KV_HEADS
    ids = torch.tensor([b for t in tables for b in t])
    seg = torch.tensor([i for i, t in enumerate(tables) for _ in t])
    valid = torch.tensor([p < n for t, n in zip(tables, lens) for p in range(len(t) * BLOCK_SIZE)])
    kb = k_cache.index_select(0, ids).transpose(1, 2)  # [blocks, KVH, BS, D]
    vb = v_cache.index_select(0, ids).transpose(1, 2)
    qb = (q * HEAD_DIM**-0.5).view(batch, NUM_KV_HEADS, groups, HEAD_DIM).index_select(0, seg)
    s = torch.matmul(qb, kb.transpose(-1, -2))  # [blocks, KVH, G, BS]
    s = s.masked_fill(~valid.view(len(ids), 1, 1, BLOCK_SIZE), float("-inf"))
    mx = torch.full((batch, NUM_KV_HEADS, groups), float("-inf"))
    mx.index_reduce_(0, seg, s.amax(-1), "amax")
    p = torch.exp(s - mx.index_select(0, seg).unsqueeze(-1))
    den = torch.zeros(batch, NUM_KV_HEADS, groups).index_add_(0, seg, p.sum(-1))
    num = torch.zeros(batch, NUM_KV_HEADS, groups, HEAD_DIM)
    num.index_add_(0, seg, torch.matmul(p, vb))
    return (num / den.unsqueeze(-1)).flatten(1)


def current(q, k_cache, v_cache, tables: list[list[int]], lens: list[int]) -> torch.Tensor:
    """`kernels.attention.paged_attention` (metadata built outside the timing, like the
    runner does once per step for all layers): per sequence, an index_select of its
    blocks' rows, then matmul / softmax / matmul over its exact length."""
    return paged_attention(q, None, None, k_cache, v_cache, _META[0])


def native_decode(q, k_cache, v_cache, tables: list[list[int]], lens: list[int]):
    """`kernels.native.paged_attention`: one C call for every decode's heads, each reading
    its keys and values straight from the cache blocks (the CPU's default)."""
    return native.paged_attention(q, None, None, k_cache, v_cache, _META[0])


_META: list = []  # the current batch's AttentionMetadata, for `current`

CANDIDATES: dict[str, Callable[..., torch.Tensor]] = {
    "padded gather (former)": padded,
    "per-sequence gather+SDPA": per_sequence,
    "flat gather+SDPA slices": flat_then_slices,
    "segment softmax": segment_softmax,
    "kernels.paged_attention": current,
    "kernels.native (default)": native_decode,
}


def time_call(fn: Callable[[], torch.Tensor], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    global NUM_HEADS, NUM_KV_HEADS, HEAD_DIM  # the formulations above read the shape here
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--min-context", type=int, default=32)
    ap.add_argument("--max-context", type=int, default=768)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--heads", type=int, default=NUM_HEADS, help="query heads")
    ap.add_argument("--kv-heads", type=int, default=NUM_KV_HEADS)
    ap.add_argument("--head-dim", type=int, default=HEAD_DIM)
    ap.add_argument("--native-only", action="store_true",
                    help="time the native kernel alone (still checked against the padded "
                         "reference)")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.heads % args.kv_heads:
        ap.error("--heads must be a multiple of --kv-heads")
    NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = args.heads, args.kv_heads, args.head_dim
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="index_reduce")
    print(describe(), flush=True)
    if not native.available():
        del CANDIDATES["kernels.native (default)"]
        print("the native kernels do not build here: left out")
    elif args.native_only:
        for name in [n for n in CANDIDATES if n != "kernels.native (default)"]:
            del CANDIDATES[name]
    print(f"{NUM_HEADS} query heads over {NUM_KV_HEADS} KV heads, head size {HEAD_DIM}, "
          f"{args.dtype}")
    rng = random.Random(0)
    for batch in (int(b) for b in args.batches.split(",")):
        lens = [rng.randint(args.min_context, args.max_context) for _ in range(batch)]
        num_blocks = sum(-(-n // BLOCK_SIZE) for n in lens) + 8
        kv_cache = torch.randn(num_blocks, 2, NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS,
                               HEAD_DIM).to(dtype)
        free = list(range(1, num_blocks))
        rng.shuffle(free)
        tables = [[free.pop() for _ in range(-(-n // BLOCK_SIZE))] for n in lens]
        k_cache, v_cache = kv_cache[:, 0, 5], kv_cache[:, 1, 5]
        q = torch.randn(batch, NUM_HEADS, HEAD_DIM).to(dtype)
        with torch.inference_mode():
            spans = [(n - 1, 1, t) for n, t in zip(lens, tables)]
            _META[:] = [build_attention_metadata(kv_cache, spans)]
            ref = padded(q, k_cache, v_cache, tables, lens)
            kv_bytes = 2 * sum(lens) * NUM_KV_HEADS * HEAD_DIM * kv_cache.element_size()
            print(f"batch {batch}: contexts {min(lens)}-{max(lens)} "
                  f"(mean {sum(lens) / batch:.0f}), {args.threads} threads, "
                  f"best of {args.repeats}")
            for name, kernel in CANDIDATES.items():
                fn = functools.partial(kernel, q, k_cache, v_cache, tables, lens)
                err = (fn().float() - ref.float()).abs().max().item()
                ms = time_call(fn, args.repeats) * 1e3
                print(f"  {name:26s} {ms:8.3f} ms/layer  {ms * NUM_LAYERS:8.2f} ms/step"
                      f"  {kv_bytes / ms / 1e6:5.1f} GB/s of K and V  max |diff| {err:.1e}")


if __name__ == "__main__":
    main()
