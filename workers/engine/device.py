"""Turn a device name from the configuration ("cpu", "cuda", "cuda:1", "npu:0") into a
`torch.device`, importing the backend that provides it."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

DEVICE_KINDS = ("cpu", "cuda", "npu")


def resolve_device(name: str | torch.device) -> torch.device:
    """The torch device for `name`; ValueError says what is missing when it is unusable."""
    if isinstance(name, torch.device):
        return name
    kind = name.split(":", 1)[0]
    if kind not in DEVICE_KINDS:
        raise ValueError(f"device {name!r}: kind must be one of {', '.join(DEVICE_KINDS)}")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: this torch build sees no CUDA device")
    if kind == "npu":
        try:
            import torch_npu  # noqa: F401  (registers the "npu" device type)
        except ImportError as exc:
            raise ValueError(
                f"device {name!r}: install torch_npu (pip install 'llmq[npu]') on an Ascend host"
            ) from exc
    return torch.device(name)
