"""docker-compose.yml validates, and every service's command is a real entry point."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
MISSING = "docker-compose is not installed (Debian: apt-get install docker-compose)"


def _compose_exe() -> str:
    """The docker-compose command. Missing: a skip on a developer's machine, a failure in
    CI (the CI environment variable set; .ci/run installs it)."""
    exe = shutil.which("docker-compose")
    if exe:
        return exe
    if os.environ.get("CI"):
        pytest.fail(MISSING)
    pytest.skip(MISSING)


def _compose_config() -> dict:
    exe = _compose_exe()
    result = subprocess.run(
        [exe, "-f", str(ROOT / "docker-compose.yml"), "config"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def test_compose_file_validates() -> None:
    config = _compose_config()
    services = config["services"]
    assert {"postgres", "redis", "redis-kv", "migrate", "web", "worker", "beat"} <= set(services)
    kv_command = " ".join(services["redis-kv"]["command"])
    assert "--maxmemory-policy allkeys-lru" in kv_command and "--maxmemory" in kv_command
    assert "--appendonly yes" in " ".join(services["redis"]["command"])
    assert "healthcheck" in services["postgres"]
    # a service that dies comes back: its jobs are reclaimed, not lost
    for name in ("postgres", "redis", "redis-kv", "web", "worker", "beat"):
        assert services[name].get("restart") == "unless-stopped", name
    for name in ("migrate", "model"):
        assert services[name].get("restart") == "on-failure", name


def test_llmq_image_is_built_here_and_never_pulled() -> None:
    """llmq:latest is in no registry: a service that runs it either builds it or is told
    never to pull it (and starts after a service that builds it)."""
    services = _compose_config()["services"]
    builders = {name for name, svc in services.items()
                if svc.get("image") == "llmq:latest" and "build" in svc}
    assert builders, "no service builds llmq:latest"
    for name, svc in services.items():
        if svc.get("image") != "llmq:latest" or name in builders:
            continue
        assert svc.get("pull_policy") == "never", name
        assert builders & set(svc.get("depends_on", {})), f"{name} may start before a build"
    # the model directory: read by web and worker, written by model; not beat's or migrate's
    for name in ("web", "worker", "model"):
        assert "/models" in str(services[name].get("volumes", [])), name
    assert "/models" not in str(services["beat"].get("volumes", []))
    # the worker's kernel build and start-up timings outlive a recreate: a named volume on
    # the image user's cache, which the image creates owned by that user (else the volume
    # would start out root's and the worker could keep neither)
    cache = "/home/llmq/.cache/llmq"
    assert any(cache in str(volume) and "worker-cache" in str(volume)
               for volume in services["worker"].get("volumes", [])), services["worker"]
    assert "worker-cache" in _compose_config()["volumes"]
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".git" in ignored and ".llmq" in ignored
    # every package the image installs is copied into it (the llmq command lives in llmq/)
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert f"mkdir -p /models {cache}" in dockerfile and "chown -R llmq /home/llmq/.cache" \
        in dockerfile
    for package in ("llmq", "webapp", "tasks", "workers", "kvcache", "kernels", "migrations"):
        assert f"COPY {package} {package}" in dockerfile, package


@pytest.mark.parametrize(
    "service", ["migrate", "model", "web", "worker", "beat"],
)
def test_service_command_is_a_real_entry_point(service: str) -> None:
    command = _compose_config()["services"][service]["command"]
    assert command[0] == "llmq", command
    # The same argv with --help must reach the project's own parser for that subcommand.
    subcommand = [arg for arg in command[1:] if not arg.startswith("-")][:2]
    if subcommand and subcommand[0] not in ("db",):
        subcommand = subcommand[:1]
    result = subprocess.run(
        [sys.executable, "-m", "llmq.cli", *subcommand, "--help"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout


@pytest.mark.parametrize(
    "service", ["migrate", "model", "web", "worker", "beat"],
)
def test_service_command_flags_are_accepted(service: str) -> None:
    """The whole argv, flags included, parses with the parser that will run it."""
    from llmq.cli import build_parser

    argv = _compose_config()["services"][service]["command"][1:]
    if argv[0] == "worker":
        # `llmq worker ...` is handed whole to the worker's own parser
        from workers.main import build_parser as worker_parser

        args = worker_parser().parse_args(argv[1:])
        assert args.model_name and args.model_dir, argv
        return
    args = build_parser().parse_args(argv)
    assert callable(args.handler), argv
