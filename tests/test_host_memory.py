"""The worker's allocator thresholds: a thread that allocates and frees multi-MB tensors
every round (as a model step does) stops faulting the same pages in again."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.pipeline_helpers import REPO

SCRIPT = textwrap.dedent("""
    import resource, sys, threading
    import torch
    if sys.argv[1] == "tuned":
        from workers.host_memory import keep_freed_memory
        assert keep_freed_memory(), "mallopt refused"
    faults = []
    def steps():
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        for _ in range(60):
            temporaries = [torch.empty(mb << 18).fill_(1.0) for mb in (4, 9, 2, 6, 12, 3)]
            del temporaries[::2]
            temporaries.append(torch.empty(5 << 18).fill_(2.0))
            del temporaries
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
    thread = threading.Thread(target=steps)
    thread.start()
    thread.join()
    print(faults[0])
""")


def _faults(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode], cwd=REPO, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip())


def test_kept_memory_is_not_faulted_in_again_every_step():
    plain, tuned = _faults("plain"), _faults("tuned")
    assert tuned * 4 < plain, (plain, tuned)
