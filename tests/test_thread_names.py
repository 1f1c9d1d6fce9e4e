"""A worker thread's OS name is its Python name (workers/thread_names.py): what `top -H`
and the batch benchmark's per-thread CPU read."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from workers.thread_names import name_this_thread


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names via /proc")
def test_a_thread_takes_its_python_name_cut_to_15_bytes():
    seen: list[str] = []

    def run() -> None:
        before = Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()
        name_this_thread()
        after = Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()
        seen.extend([before, after])

    thread = threading.Thread(target=run, name="llmq-step-publisher")
    thread.start()
    thread.join()
    assert seen[0] != "llmq-step-publi"  # not named until it asks
    assert seen[1] == "llmq-step-publi"
