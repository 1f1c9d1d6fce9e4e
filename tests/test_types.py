"""The packages type-check: `mypy` (configured in pyproject.toml) finds no error in them,
so a type the code states is one a reader can trust."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ["webapp", "tasks", "workers", "kvcache", "kernels", "llmq"]


def test_the_packages_type_check():
    result = subprocess.run([sys.executable, "-m", "mypy", *PACKAGES], cwd=REPO,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"mypy found errors:\n{result.stdout[-6000:]}{result.stderr}"
