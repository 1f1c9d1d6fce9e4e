"""Browser test helpers: the system chromium, a recorded tab, a proxy that cuts connections."""

from __future__ import annotations

import os
import re
import shutil
import socket
import threading
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
MISSING = "chromium is not installed (Debian: apt-get install chromium)"
TIMEOUT_MS = 60_000


def chromium_executable() -> str:
    """The browser to drive. Missing: a skip on a developer's machine, a failure in CI
    (the CI environment variable set; .ci/run installs it)."""
    exe = CHROMIUM if os.path.exists(CHROMIUM) else shutil.which("chromium")
    if exe:
        return exe
    if os.environ.get("CI"):
        pytest.fail(MISSING)
    pytest.skip(MISSING)


class Tab:
    """One browser tab; records every console error and uncaught exception."""

    def __init__(self, browser, base_url: str) -> None:
        self.context = browser.new_context(viewport={"width": 1440, "height": 900})
        self.page = self.context.new_page()
        self.page.set_default_timeout(TIMEOUT_MS)
        self.base_url = base_url
        self.errors: list[str] = []
        self.page.on("console", lambda message: message.type == "error"
                     and self.errors.append(f"console: {message.text}"))
        self.page.on("pageerror", lambda error: self.errors.append(f"exception: {error}"))

    def open(self, fragment: str = "#/") -> None:
        self.page.goto(f"{self.base_url}/{fragment}")

    def assert_no_errors(self, allowed: str | None = None) -> None:
        errors = [e for e in self.errors if allowed is None or not re.search(allowed, e)]
        assert errors == [], errors

    def screenshot(self, name: str) -> None:
        directory = os.environ.get("LLMQ_SCREENSHOTS_DIR")
        if directory:
            Path(directory).mkdir(parents=True, exist_ok=True)
            self.page.screenshot(path=str(Path(directory) / f"{name}.png"))

    def close(self) -> None:
        self.context.close()


class DroppingProxy:
    """A TCP proxy in front of the web app whose open connections the test can cut: a
    real network drop in the middle of a response, seen by the browser as one."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.removeprefix("http://").split(":")
        self.upstream = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.open: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            with self.lock:
                self.open += [client, server]
            for source, target in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(source, target), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, target: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                target.sendall(data)
        except OSError:
            pass
        for sock in (source, target):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def drop(self) -> None:
        """Cut every open connection (both sides)."""
        with self.lock:
            sockets, self.open = self.open, []
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def close(self) -> None:
        self.listener.close()
        self.drop()
