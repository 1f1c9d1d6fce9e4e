"""Shared fixtures. Model checkpoints and services each live in their own plugin module."""

import fcntl
import os
from collections.abc import Iterator
from typing import IO

import pytest

# NOTE: the suite compares batched, served and offline outputs with solo and Hugging Face
# ones token for token, which only fp32 guarantees (bf16 rounds differently per batch
# shape). dtype="auto" would pick bf16 on a CPU with native bf16, so pin its meaning here,
# before anything loads a model: worker subprocesses inherit the variable, and the loader
# reads it for "auto" (tests of bf16 itself pass dtype="bfloat16").
os.environ["LLMQ_DTYPE"] = "float32"
# The same for the linear path: the start-up timing could pick another one in a worker
# subprocess than in the test process, and fp32 results differ in the last bits between them.
os.environ["LLMQ_LINEAR_PATH"] = "prepacked"
# A test that asks for `auto` times the paths itself, not reads what another run kept
# (tests/test_startup_timings.py turns the cache on in a directory of its own).
os.environ["LLMQ_TIMINGS_CACHE"] = "off"

pytest_plugins = ["tests.fixtures_models", "tests.fixtures_services"]


@pytest.fixture(autouse=True)
def _kernel_choices_restored():
    """A ModelRunner puts the native step kernels in `kernels.dispatch` for the whole
    process (LLMQ_CPU_KERNELS); give every test the kernel choices it started with, so a
    test of the pure-torch references never runs another test's choice."""
    from kernels import dispatch

    overrides, chosen = dict(dispatch._overrides), dict(dispatch._chosen)
    yield
    dispatch._overrides.clear()
    dispatch._overrides.update(overrides)
    dispatch._chosen.clear()
    dispatch._chosen.update(chosen)


@pytest.fixture(scope="session")
def _alone_lock(tmp_path_factory: pytest.TempPathFactory) -> Iterator[IO[str] | None]:
    """Under pytest-xdist (the README's `-n 2`), a file every test process of the run
    opens: its flock keeps the tests marked `alone` from sharing the machine. None in a
    run of one process."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield None
        return
    # the parent of a test process's base directory is the run's, shared by them all
    with open(tmp_path_factory.getbasetemp().parent / "alone.lock", "a") as lock:
        yield lock


@pytest.fixture(autouse=True)
def _alone_when_marked(request: pytest.FixtureRequest, _alone_lock: IO[str] | None):
    """A test marked `alone` (it asserts a latency or a deadline) holds the run's lock
    exclusively, every other test shares it: the marked test starts once the other test
    process's current test ends, and that process waits for it before its next one."""
    if _alone_lock is None:
        yield
        return
    alone = request.node.get_closest_marker("alone") is not None
    fcntl.flock(_alone_lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
    try:
        yield
    finally:
        fcntl.flock(_alone_lock, fcntl.LOCK_UN)
