"""`llmq up` on a fresh machine: no Redis or database given, so it starts the embedded
Redis and uses SQLite in its state directory; a completion works over HTTP; a worker
killed with SIGKILL is started again and serves; SIGTERM stops every process it started."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from tests.fixtures_services import free_port

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent
READY_LINE = "llmq is ready at "


def _descendants(pid: int) -> set[int]:
    """Every live process below `pid` (from /proc)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        ppid = int(next(line.split()[1] for line in status.splitlines()
                        if line.startswith("PPid:")))
        parents.setdefault(ppid, []).append(int(entry.name))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _gone(pid: int) -> bool:
    """Exited and waited on (a zombie still has its /proc entry: nobody reaped it)."""
    return not Path(f"/proc/{pid}").exists()


def _describe(pid: int) -> str:
    """A process's state (Z: a zombie nobody reaped) and command line, for a failure."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        state = "?"
    return f"{state} {_cmdline(pid)}"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _complete(base: str) -> dict:
    response = requests.post(f"{base}/v1/completions", timeout=90, json={
        "model": "demo", "prompt": "hello", "max_tokens": 5, "temperature": 0.0,
        "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response.json()


def test_llmq_up_serves_a_completion_and_stops_cleanly(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMQ_")}
    env["PYTHONPATH"] = str(REPO)
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "llmq.cli", "up", "--state-dir", str(tmp_path / "state"),
         "--port", str(port), "--demo-preset", "tiny"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout],
                     daemon=True).start()
    output: list[str] = []

    def read_until(marker: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not any(marker in line for line in output):
            assert process.poll() is None, "llmq up exited:\n" + "".join(output)
            assert time.monotonic() < deadline, f"no {marker!r}:\n" + "".join(output)
            try:
                output.append(lines.get(timeout=1))
            except queue.Empty:
                pass

    try:
        read_until("Ctrl-C stops everything", 90)
        text = "".join(output)
        assert READY_LINE in text and "creating a tiny demo checkpoint" in text
        assert "embedded Redis" in text
        # the schema in one line of its own words, not the migration tool's log
        assert "migrations applied, now at 00" in text and "alembic" not in text
        assert f"curl http://127.0.0.1:{port}/v1/completions" in text
        assert (tmp_path / "state" / "llmq.db").exists()  # SQLite in the state dir

        base = f"http://127.0.0.1:{port}"
        body = _complete(base)
        assert body["choices"][0]["text"] and body["usage"]["completion_tokens"] == 5
        ready = requests.get(f"{base}/ready", timeout=30)
        assert ready.status_code == 200 and ready.json()["checks"]["workers"] == {"demo": 1}

        # a worker that dies is started again, and the stack goes on serving
        (worker,) = [pid for pid in _descendants(process.pid)
                     if "workers.main" in _cmdline(pid)]
        os.kill(worker, signal.SIGKILL)
        read_until("worker exited with code -9; starting it again", 30)
        assert _complete(base)["choices"][0]["text"] == body["choices"][0]["text"]

        children = _descendants(process.pid)
        assert worker not in children
        assert len(children) >= 4  # redis, worker, beat, web (+ gunicorn's worker)
        # a burst of stop signals (an impatient Ctrl-C, a supervisor's SIGTERM): the
        # first one stops the stack, the others must not cut that stop short
        for sig in (signal.SIGTERM, signal.SIGTERM, signal.SIGINT, signal.SIGTERM):
            process.send_signal(sig)
            time.sleep(0.02)
        assert process.wait(60) == 0, "".join(output)
        still_there = {pid: _describe(pid) for pid in children if not _gone(pid)}
        assert not still_there, f"processes left behind: {still_there}"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


ORPHAN_SCRIPT = """
import json, sys, time
from pathlib import Path
from llmq.stack import LocalStack
stack = LocalStack(Path(sys.argv[1]))
# the child starts a grandchild that ignores SIGTERM, and exits at once: an orphan
child = stack.spawn("web", ["sh", "-c", "(trap '' TERM; sleep 60) & echo $! > %s/pid"
                            % sys.argv[1]], {})
child.process.wait()
time.sleep(0.5)
orphan = int(Path(sys.argv[1], "pid").read_text())
parent = int(Path(f"/proc/{orphan}/stat").read_text().rsplit(")", 1)[1].split()[1])
stack.stop()
print(json.dumps({"orphan": orphan, "adopted": parent == __import__("os").getpid(),
                  "gone": not Path(f"/proc/{orphan}").exists()}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a Linux subreaper")
def test_stop_reaps_what_a_child_left_behind(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", ORPHAN_SCRIPT, str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["adopted"] and result["gone"]
