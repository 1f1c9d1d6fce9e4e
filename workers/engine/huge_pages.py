"""The model's weights and the KV cache in transparent huge pages (CPU, Linux).

A decode step of few rows streams every weight from memory once, so it runs at the speed
memory reads go. In 4 KiB pages that stream crosses a page every 4 KiB (100,000 pages a
step for 400 MB of weights), and every crossing is a TLB lookup the loads and the
prefetches wait on; in 2 MiB pages it is 200. Linux gives a process huge pages where it
asks for them (`madvise(MADV_HUGEPAGE)`, the default "madvise" mode of
/sys/kernel/mm/transparent_hugepage/enabled) and torch's allocations do not ask. So once
the linear plan is applied, `move_to_huge_pages` copies every weight the model still
holds into one mapping that asks, and the KV cache is made in one (`zeros`).

Measured on a Xeon with AMX (2 threads, docs/benchmarks.md): a 1 GiB sum 25.0-25.4 ->
29.1-29.2 GB/s; the native projection kernel over the 100m model's weights at one row
0.97x the time in fp32, 0.93x in bf16.

`LLMQ_HUGE_PAGES=off` keeps torch's allocations. Where the kernel has no transparent huge
pages ("never", or not Linux) nothing moves.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
from pathlib import Path

import torch
from torch import nn

logger = logging.getLogger(__name__)

SETTING_ENV = "LLMQ_HUGE_PAGES"  # "auto" (default) or "off"
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
HUGE_PAGE_BYTES = 2 * 1024 * 1024
# each tensor's bytes start on a cache line (any dtype's element size divides it)
_ALIGN = 64


def thp_mode(path: Path = THP_SETTING) -> str:
    """The kernel's transparent huge page mode ("always", "madvise", "never"), or "" where
    it cannot be read."""
    try:
        text = path.read_text()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else ""


def setting() -> str:
    value = os.environ.get(SETTING_ENV, "auto").strip().lower() or "auto"
    if value not in ("auto", "off"):
        raise ValueError(f"{SETTING_ENV}={value!r}: expected 'auto' or 'off'")
    return value


def available() -> bool:
    """True where asking for huge pages can get them: not turned off, and the kernel's
    mode is "always" or "madvise"."""
    return (setting() == "auto" and hasattr(mmap, "MADV_HUGEPAGE")
            and thp_mode() in ("always", "madvise"))


def _mapping(nbytes: int) -> torch.Tensor:
    """`nbytes` of zeroed memory (uint8) starting on a huge page, in a private anonymous
    mapping that asks for huge pages. The tensor keeps the mapping alive."""
    region = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES,
                       flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(region, dtype=torch.uint8)
    skip = -whole.data_ptr() % HUGE_PAGE_BYTES
    return whole[skip:skip + nbytes]


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros in huge pages where `available()`, else `torch.zeros`. Its
    pages are written now, as `torch.zeros` does: left to fault in on first use, each
    costs a 2 MiB clear inside a step (the mixed workload of bench_engine, fp32, Xeon:
    about 5% slower that way, at par with 4 KiB pages when touched up front)."""
    if not available():
        return torch.zeros(shape, dtype=dtype)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return _mapping(max(nbytes, 1))[:nbytes].view(dtype).view(shape).zero_()


def move_to_huge_pages(model: nn.Module) -> int:
    """Copy every strided CPU parameter and buffer of `model` into one huge-page mapping;
    returns the bytes moved (0 where not `available()`). Tensors sharing a storage (tied
    weights, views) keep sharing it; a Parameter stays the same object (`.data` is
    replaced). Call before anything keeps a weight's address (the native decoder)."""
    if not available():
        return 0
    # every (module, name, tensor, is_parameter), tensors grouped by the storage they view
    slots: list[tuple[nn.Module, str, torch.Tensor, bool]] = []
    storages: dict[int, torch.UntypedStorage] = {}
    for module in model.modules():
        for tensors, is_param in ((module._parameters, True), (module._buffers, False)):
            for name, tensor in tensors.items():
                if (tensor is None or tensor.device.type != "cpu"
                        or tensor.layout != torch.strided or tensor.is_mkldnn):
                    continue
                storage = tensor.untyped_storage()
                storages.setdefault(storage.data_ptr(), storage)
                slots.append((module, name, tensor, is_param))
    offsets: dict[int, int] = {}
    total = 0
    for key, storage in storages.items():
        offsets[key] = total
        total += -(-storage.nbytes() // _ALIGN) * _ALIGN
    if not total:
        return 0
    arena = _mapping(total)
    for key, storage in storages.items():
        old = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
        arena[offsets[key]:offsets[key] + storage.nbytes()].copy_(old)
    arena_storage = arena.untyped_storage()
    base = arena.storage_offset()  # bytes into the mapping's storage
    moved: dict[int, torch.Tensor] = {}  # id of a tensor (Parameters once) -> its copy
    for module, name, tensor, is_param in slots:
        copy = moved.get(id(tensor))
        if copy is None:
            element = tensor.element_size()
            start = base + offsets[tensor.untyped_storage().data_ptr()]
            copy = torch.empty(0, dtype=tensor.dtype).set_(
                arena_storage, start // element + tensor.storage_offset(), tensor.shape,
                tensor.stride())
            moved[id(tensor)] = copy
            if is_param:
                tensor.data = copy
        if not is_param:
            module._buffers[name] = copy
    logger.info("%.1f MB of weights moved into huge pages", total / 1e6)
    return total
