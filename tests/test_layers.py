"""The house stands: no import runs from a lower layer to a higher one.

Layers, lowest first (docs/architecture.md names them the same way):

    kernels, kvcache            tensor functions; KV block bookkeeping and tiers
    tasks                       the contract (settings, params, schema, protocol, models, streams)
    workers.engine              the engine (from the contract: tasks.params, tasks.structured)
    workers                     the device-group service
    webapp                      the Flask app (over the contract only)
    llmq                        the CLI and `llmq up`: may import every layer

Every import statement of every module is read with `ast` (function-level imports too,
since a lazy import is still an edge), so a forbidden edge fails here before it ships.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kernels", "kvcache", "tasks", "webapp", "workers", "llmq", "migrations")
HEAVY = ("torch", "torch_npu", "safetensors", "numpy")

# layer -> the project packages (dotted prefixes) its modules may import
ALLOWED: dict[str, tuple[str, ...]] = {
    "kernels": ("kernels",),
    "kvcache": ("kvcache",),
    "tasks": ("tasks",),
    "migrations": ("tasks", "migrations"),
    "webapp": ("tasks", "webapp"),
    "workers.engine": ("workers.engine", "kernels", "kvcache", "tasks.params",
                       "tasks.structured"),
    "workers": ("workers", "tasks", "kvcache"),
    "llmq": PACKAGES,
}
# layers that must start without torch: the web process scales by processes
LIGHT = ("tasks", "webapp", "migrations")


def layer_of(module: str) -> str:
    if module == "workers.engine" or module.startswith("workers.engine."):
        return "workers.engine"
    return module.split(".")[0]


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, dotted module) of every import in the file, relative ones resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((node.lineno, target))
            # `from workers import engine` names a submodule: count it as that edge
            found.extend((node.lineno, f"{target}.{alias.name}") for alias in node.names
                         if is_module(root / Path(*target.split("."), alias.name)))
    return found


def is_module(path: Path) -> bool:
    return path.is_dir() or path.with_suffix(".py").is_file()


def project_files(root: Path = ROOT) -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (root / pkg).rglob("*.py"))


def is_under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def forbidden_edges(root: Path = ROOT) -> list[str]:
    edges = []
    for path in project_files(root):
        here = layer_of(module_name(path, root))
        for line, target in imports_of(path, root):
            top = target.split(".")[0]
            if top in PACKAGES and not any(is_under(target, ok) for ok in ALLOWED[here]):
                edges.append(f"{path.relative_to(root)}:{line} ({here}) imports {target}")
            if here in LIGHT and top in HEAVY:
                edges.append(f"{path.relative_to(root)}:{line} ({here}) imports {target}, "
                             "which the web process must never load")
    return edges


def test_every_project_module_belongs_to_a_layer():
    assert project_files(), "no project modules found: the test reads the wrong tree"
    for path in project_files():
        assert layer_of(module_name(path)) in ALLOWED, path


def test_no_import_runs_up_a_layer():
    edges = forbidden_edges()
    assert not edges, "imports that break the layering (docs/architecture.md):\n" + "\n".join(edges)


def test_the_rule_catches_upward_edges(tmp_path):
    """The walker itself, on a small tree: a lazy kernel->engine import, a relative
    engine->service import and the web loading torch are each reported."""
    for pkg in ("kernels", "workers/engine", "webapp"):
        (tmp_path / pkg).mkdir(parents=True)
    (tmp_path / "kernels" / "bad.py").write_text(
        "def f():\n    from workers.engine.sampler import sample\n")
    (tmp_path / "workers" / "engine" / "core.py").write_text("from .. import batcher\n")
    (tmp_path / "workers" / "batcher.py").write_text("from workers.engine import core\n")
    (tmp_path / "webapp" / "views.py").write_text("import torch\n")
    assert forbidden_edges(tmp_path) == [
        "kernels/bad.py:2 (kernels) imports workers.engine.sampler",
        "webapp/views.py:1 (webapp) imports torch, which the web process must never load",
        "workers/engine/core.py:1 (workers.engine) imports workers",
        "workers/engine/core.py:1 (workers.engine) imports workers.batcher",
    ]


@pytest.mark.parametrize("module", ["webapp", "webapp.wsgi", "tasks.maintenance",
                                    "tasks.streams.reader", "llmq.cli"])
def test_light_modules_start_without_torch(module):
    """Importing the web app, the contract or the CLI's entry point loads no torch."""
    code = (f"import sys, {module}; "
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
            f"{HEAVY!r} or m.startswith(('workers', 'kvcache', 'kernels'))); "
            "print(','.join(heavy))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"{module} loaded {result.stdout.strip()}"
