"""Run every device group of a host topology as its own worker process.

`llmq worker --devices 0,1,2,3 --tp 2` starts one child `python -m workers.main ...
--group-index i` per group and waits on them. SIGTERM / SIGINT are forwarded to every
child (each drains its jobs). When one group exits on its own (a lost TP rank, a crash),
the others are stopped too and the supervisor exits non-zero, so whatever restarts the
worker (compose, systemd, Kubernetes) restarts the whole host topology at once.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from types import FrameType

logger = logging.getLogger(__name__)


def run_groups(argv: list[str], num_groups: int, group_id: str | None) -> int:
    """Start `num_groups` children with `argv` plus their group index; wait on them all.

    Returns 0 when every child exited 0 (a requested shutdown), else the first non-zero
    exit code (a negative code is a signal number).
    """
    children: list[subprocess.Popen[bytes]] = []
    for index in range(num_groups):
        extra = ["--group-index", str(index)]
        if group_id:
            extra += ["--group-id", f"{group_id}-g{index}"]  # the last flag wins
        children.append(subprocess.Popen([sys.executable, "-m", "workers.main", *argv,
                                          *extra]))
    logger.info("started %d device groups: pids %s", num_groups, [c.pid for c in children])
    stopping = False

    def forward(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        _signal_all(children, signal.SIGTERM)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    exit_code = 0
    try:
        while any(child.poll() is None for child in children):
            for index, child in enumerate(children):
                code = child.poll()
                if code is None or code == 0 and stopping:
                    continue
                if exit_code == 0 and code != 0:
                    exit_code = code
                if not stopping:
                    logger.error("device group %d (pid %d) exited with %s; stopping the "
                                 "other groups", index, child.pid, code)
                    stopping = True
                    _signal_all(children, signal.SIGTERM)
            time.sleep(0.2)
        for child in children:
            if child.returncode and exit_code == 0:
                exit_code = child.returncode
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return exit_code


def _signal_all(children: list[subprocess.Popen[bytes]], signum: int) -> None:
    for child in children:
        if child.poll() is None:
            child.send_signal(signum)
