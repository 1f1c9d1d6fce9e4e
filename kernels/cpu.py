"""What this CPU can do, read once: its model and ISA flags, whether it computes bf16
natively, and a one-line description that every speed figure is printed beside.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

import torch

# the flags that decide which GEMM path is fast (and so which figures are comparable)
SPEED_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16",
               "amx_tile")
# bf16 dot products in hardware: AVX512-BF16 (Zen 4, Cooper Lake) or AMX (Sapphire Rapids)
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.cache
def _cpuinfo() -> tuple[str, frozenset[str]]:
    """(model name, flags) of the first processor in /proc/cpuinfo; ("", {}) elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor(), frozenset()
    model = ""
    flags: frozenset[str] = frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
    return model, flags


def cpu_flags() -> frozenset[str]:
    return _cpuinfo()[1]


def cpu_description_key() -> str:
    """This CPU's model, architecture and every flag, as one string: what a build for
    `-march=native` depends on."""
    model, flags = _cpuinfo()
    return f"{platform.machine()}|{model}|{' '.join(sorted(flags))}"


@functools.cache
def has_native_bf16() -> bool:
    """True when the CPU multiplies bf16 in hardware, so bf16 weights halve the bytes a
    step reads without an emulation cost."""
    return any(flag in cpu_flags() for flag in NATIVE_BF16_FLAGS)


def describe() -> str:
    """CPU model, speed-relevant ISA flags, torch threads, torch / MKL / oneDNN versions."""
    model, flags = _cpuinfo()
    present = [f for f in SPEED_FLAGS if f in flags] or ["(flags unknown)"]
    mkl = "MKL" if torch.backends.mkl.is_available() else "no MKL"
    config = torch.__config__.show()
    for line in config.splitlines():
        if "Math Kernel Library Version" in line:
            mkl = "MKL " + line.split("Version")[1].split("-")[0].strip()
    onednn = "oneDNN ?"
    for line in config.splitlines():
        if "MKL-DNN v" in line:
            onednn = "oneDNN " + line.split("MKL-DNN v")[1].split()[0]
    return (f"CPU {model or platform.machine()} [{' '.join(present)}], "
            f"{torch.get_num_threads()} torch threads, torch {torch.__version__}, {mkl}, "
            f"{onednn}")
