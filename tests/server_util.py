"""Start a real lmserve process on a free loopback port for end-to-end tests."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.hooked_server import Hooks

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> int:
    """The first of `n` consecutive free ports (`mlx.launch --starting-port`: the ring binds one
    per rank, from there up; a port after a free one may be taken)."""
    while True:
        base = free_port()
        with contextlib.ExitStack() as held:
            try:
                for port in range(base, base + n):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
        return base


@dataclass
class Server:
    base_url: str
    process: subprocess.Popen
    log_path: str

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


@contextlib.contextmanager
def start_server(*args: str, env: dict[str, str] | None = None, timeout: float = 120.0,
                 hooks: Hooks | None = None) -> Iterator[Server]:
    """Run `python -m lmserve.cli ARGS --port P` and yield once /health answers. With `hooks`, the
    same through `python -m tests.hooked_server`, which installs them first."""
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="lmserve-", suffix=".log", delete=False)  # noqa: SIM115
    env = {**os.environ, **(env or {})}
    entry = ["lmserve.cli"]
    if hooks is not None:
        entry = ["tests.hooked_server", *hooks.argv(), "--"]
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.Popen(
        [sys.executable, "-m", *entry, *args, "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )
    server = Server(f"http://127.0.0.1:{port}", proc, log.name)
    try:
        wait_until_healthy(proc, server.base_url, timeout, server.log)
        yield server
    finally:
        stop_process(proc)
        os.unlink(log.name)


def wait_until_healthy(proc: subprocess.Popen, base_url: str, timeout: float, log: Callable[[], str]) -> None:
    """Until `GET /health` answers 200 (lmserve's and llama-server's alike); RuntimeError with the
    process's `log()` when it exits first or the timeout passes."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"server did not become healthy:\n{log()}")
        time.sleep(0.1)


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 10 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def chat_chunks(base_url: str, body: dict, timeout: float = 600, client: httpx.Client | None = None) -> Iterator[dict]:
    """The JSON chunks of one streaming `/v1/chat/completions` reply, as they arrive; on `client`'s
    connections where given (a new client's TLS set-up costs 20-30 ms of the request's time)."""
    with (client or httpx).stream("POST", base_url + "/v1/chat/completions", json=body, timeout=timeout) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                yield json.loads(line[6:])


def health(server: Server) -> dict:
    return httpx.get(server.base_url + "/health", timeout=30).json()


def wait_for(predicate, timeout: float = 90.0) -> None:
    """Poll until `predicate()` holds; the tests count what the server did instead of timing it."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)
