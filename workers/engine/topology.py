"""Device groups: how a worker host's devices split into groups, and what a group needs.

    --device cuda --devices 0,1,2,3 --tp 2   ->  group 0 = cuda:0,cuda:1; group 1 = cuda:2,cuda:3

A group is the devices one worker process owns; its model is split over them with tensor
parallelism (`tp` ranks, one per device). Several groups of one model consume the same
queue: that is data parallelism, on one host or many. On CPU the "devices" are logical
ranks: `--devices 0,1 --tp 2` is one group of two CPU rank processes.

Everything here is plain data and checks that fail with a message saying what to change.
Nothing imports torch at module import.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import Enum
from typing import Any

logger = logging.getLogger(__name__)


class TopologyError(ValueError):
    """The requested devices / TP layout cannot run here; the message says what to change."""


class DeviceKind(str, Enum):
    CPU = "cpu"
    CUDA = "cuda"
    NPU = "npu"  # Ascend, through torch_npu

    @property
    def dist_backend(self) -> str:
        """The torch.distributed backend of tensor parallelism on this kind of device."""
        return {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}[self.value]


@dataclass(slots=True)
class DeviceGroup:
    """One group: its devices in rank order (rank r runs on `devices[r]`)."""

    index: int  # 0.. within this host's topology
    kind: DeviceKind
    devices: list[int]  # device indices; logical rank numbers on CPU

    @property
    def tp_size(self) -> int:
        return len(self.devices)

    def device_name(self, rank: int) -> str:
        """The torch device string of `rank`: "cpu", "cuda:2", "npu:0"."""
        if self.kind is DeviceKind.CPU:
            return "cpu"
        return f"{self.kind.value}:{self.devices[rank]}"

    @property
    def device_names(self) -> list[str]:
        return [self.device_name(rank) for rank in range(self.tp_size)]


@dataclass(slots=True)
class Topology:
    kind: DeviceKind
    devices: list[int]  # every device of this host the worker was given, in order
    tp_size: int
    groups: list[DeviceGroup]


@dataclass(slots=True)
class GroupTopology:
    """What a running group reports in its heartbeat (plain JSON-able data)."""

    device_kind: str  # "cpu" | "cuda" | "npu"
    devices: list[str]  # torch device names in rank order, e.g. ["cuda:0", "cuda:1"]
    tp_size: int
    num_kv_blocks: int  # KV cache capacity (the same block ids on every rank)
    num_kv_tokens: int  # num_kv_blocks * block_size
    rank_pids: list[int]  # process id of each TP rank (rank 0 = the worker process)


def parse_device_kind(device: str) -> tuple[DeviceKind, int | None]:
    """`"cuda:1"` -> (CUDA, 1); `"npu"` -> (NPU, None)."""
    kind_name, _, index = device.partition(":")
    try:
        kind = DeviceKind(kind_name.strip().lower())
    except ValueError:
        raise TopologyError(
            f"device {device!r}: the kind must be one of "
            f"{', '.join(k.value for k in DeviceKind)} (e.g. --device cuda)"
        ) from None
    if not index:
        return kind, None
    if not index.isdigit():
        raise TopologyError(f"device {device!r}: the index after ':' must be a number")
    return kind, int(index)


def parse_devices(text: str) -> list[int]:
    """`"0,1,2,3"` or `"0-3"` (or a mix, `"0,2-3"`) -> [0, 1, 2, 3]; duplicates refused."""
    devices: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise TopologyError(
                f"--devices {text!r}: {part!r} is not a device index or a range like 0-3"
            )
        first, last = int(low), int(high) if dash else int(low)
        if last < first:
            raise TopologyError(f"--devices {text!r}: range {part!r} runs backwards")
        devices.extend(range(first, last + 1))
    if not devices:
        raise TopologyError(f"--devices {text!r}: give at least one device index, e.g. 0,1")
    duplicates = sorted({d for d in devices if devices.count(d) > 1})
    if duplicates:
        raise TopologyError(f"--devices {text!r}: device(s) {duplicates} listed twice")
    return devices


def build_topology(device: str, devices: list[int] | None, tp_size: int) -> Topology:
    """Split `devices` of kind `device` into groups of `tp_size` consecutive devices.

    Without `devices`: the device index in `device` ("cuda:1") for tp 1, else 0..tp-1.
    """
    kind, index = parse_device_kind(device)
    if tp_size < 1:
        raise TopologyError(f"--tp {tp_size}: the tensor-parallel size must be >= 1")
    if devices is None:
        if index is not None and tp_size == 1:
            devices = [index]
        elif index is not None:
            raise TopologyError(
                f"--device {device} names one device but --tp {tp_size} needs {tp_size}: "
                f"pass --device {kind.value} --devices with {tp_size} indices"
            )
        else:
            devices = list(range(tp_size))
    elif index is not None:
        raise TopologyError(
            f"--device {device} names a device index and --devices lists devices too: "
            f"pass --device {kind.value} --devices {','.join(map(str, devices))}"
        )
    if len(devices) % tp_size:
        raise TopologyError(
            f"{len(devices)} device(s) {devices} do not split into groups of --tp {tp_size}: "
            f"give a multiple of {tp_size} devices or change --tp"
        )
    groups = [DeviceGroup(i, kind, devices[i * tp_size:(i + 1) * tp_size])
              for i in range(len(devices) // tp_size)]
    return Topology(kind=kind, devices=list(devices), tp_size=tp_size, groups=groups)


def check_backend(topology: Topology) -> None:
    """Raise TopologyError when this host cannot run `topology` (missing backend, missing
    device indices). Imports torch (and torch_npu for NPU)."""
    import torch

    kind = topology.kind
    if kind is DeviceKind.CUDA:
        if not torch.cuda.is_available():
            raise TopologyError(
                "--device cuda: this torch build sees no CUDA device; install a CUDA build "
                "of torch (pip install torch --index-url https://download.pytorch.org/whl/"
                "cu121, matching your driver) on a host with NVIDIA GPUs, or use --device cpu"
            )
        count = torch.cuda.device_count()
    elif kind is DeviceKind.NPU:
        try:
            import torch_npu  # noqa: F401  (registers the "npu" device type)
        except ImportError:
            raise TopologyError(
                "--device npu: torch_npu is not installed; on an Ascend host with the CANN "
                "toolkit run: pip install \"llmq[npu]\" (torch_npu matching your torch), "
                "or use --device cpu"
            ) from None
        count = torch.npu.device_count()  # type: ignore[attr-defined]
        if count == 0:
            raise TopologyError("--device npu: torch_npu sees no Ascend device; check the "
                                "CANN driver (npu-smi info) or use --device cpu")
    else:
        return  # CPU ranks are logical: any number runs (slowly past the core count)
    missing = [d for d in topology.devices if d >= count]
    if missing:
        raise TopologyError(
            f"--devices {','.join(map(str, topology.devices))}: device(s) {missing} do not "
            f"exist; this host has {count} {kind.value} device(s) (0..{count - 1})"
        )


def check_model(hf_config: dict[str, Any], tp_size: int) -> None:
    """Raise TopologyError when the checkpoint's shapes do not split `tp_size` ways."""
    if tp_size == 1:
        return
    num_heads = int(hf_config["num_attention_heads"])
    num_kv_heads = int(hf_config.get("num_key_value_heads") or num_heads)
    sizes = {
        "attention heads (num_attention_heads)": num_heads,
        "KV heads (num_key_value_heads)": num_kv_heads,
        "intermediate_size": int(hf_config["intermediate_size"]),
        "vocab_size": int(hf_config["vocab_size"]),
    }
    for what, size in sizes.items():
        if size % tp_size:
            divisors = [d for d in range(1, min(num_heads, num_kv_heads) + 1)
                        if num_heads % d == 0 and num_kv_heads % d == 0
                        and all(s % d == 0 for s in sizes.values())]
            raise TopologyError(
                f"--tp {tp_size} does not divide the model's {size} {what}; use a TP size "
                f"in {divisors}"
            )


def check_model_dir(model_dir: str, tp_size: int) -> None:
    """`check_model` against `<model_dir>/config.json`."""
    import json
    from pathlib import Path

    path = Path(model_dir) / "config.json"
    try:
        hf_config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise TopologyError(f"{path}: cannot read the model config ({exc})") from exc
    check_model(hf_config, tp_size)
