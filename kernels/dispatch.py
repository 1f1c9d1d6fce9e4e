"""The one place that picks which implementation of each kernel runs on a device.

The pure-torch functions in this package are the reference and the default on every
device. A backend (CUDA, Ascend `torch_npu`) may register a faster function under the same
name and signature for its device type:

    from kernels import dispatch
    dispatch.register("paged_attention", "npu", my_npu_paged_attention)

The first lookup of each (name, device type) logs which implementation was chosen.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

logger = logging.getLogger(__name__)

KERNEL_NAMES = (
    "rms_norm",
    "fused_add_rms_norm",
    "apply_rotary",
    "silu_and_mul",
    "store_kv",
    "paged_attention",
    "apply_penalties",
    "apply_token_bitmask",
    "greedy_sample",
    "filter_min_p",
    "sample_by_cdf",
    "top_k_top_p_sample",
    "gather_logprobs",
)

_overrides: dict[tuple[str, str], Callable] = {}
_chosen: dict[tuple[str, str], Callable] = {}


def _reference(name: str) -> Callable:
    from kernels import activation, attention, norms, rotary, sampling

    for module in (norms, rotary, activation, attention, sampling):
        fn = getattr(module, name, None)
        if fn is not None:
            return fn
    raise KeyError(name)


def register(name: str, device_type: str, fn: Callable) -> None:
    """Use `fn` for kernel `name` on devices of `device_type` ("cuda", "npu", "cpu")."""
    if name not in KERNEL_NAMES:
        raise ValueError(f"unknown kernel {name!r}; kernels are {', '.join(KERNEL_NAMES)}")
    _overrides[(name, device_type)] = fn
    _chosen.pop((name, device_type), None)


def unregister(name: str, device_type: str) -> None:
    """Go back to the reference implementation of `name` on `device_type`."""
    _overrides.pop((name, device_type), None)
    _chosen.pop((name, device_type), None)


def get(name: str, device_type: str) -> Callable:
    """The implementation of kernel `name` for tensors on `device_type`."""
    key = (name, device_type)
    fn = _chosen.get(key)
    if fn is None:
        fn = _overrides.get(key)
        if fn is None:
            fn = _reference(name)
            logger.info("kernel %s on %s: pure-torch reference", name, device_type)
        else:
            logger.info("kernel %s on %s: %s.%s", name, device_type, fn.__module__,
                        fn.__qualname__)
        _chosen[key] = fn
    return fn


def log_choices(device_type: str) -> None:
    """Resolve (and so log) the implementation of every kernel on `device_type`; the
    runner calls this when it starts, so the choice is in the log before the first step."""
    for name in KERNEL_NAMES:
        get(name, device_type)
