"""lmserve with test hooks that production code has no place for, started by tests/server_util.py:

    python -m tests.hooked_server [--fault-marker MARKER] [--available-memory BYTES] [--memory-limit BYTES]
                                  [--script FILE] [--record FILE] [--drafts-always-pay] -- LMSERVE ARGS

The hooks are installed here, around the real code, before `lmserve.cli.main(LMSERVE ARGS)` runs:

- `--fault-marker`: the engine is wrapped in `FaultyEngine`. A request whose prompt contains MARKER
  fails in the worker at its third generated token, after its reply has started streaming, and
  alone: the sequences decoded in the same step go on.
- `--available-memory`: psutil reports that many bytes available, so the RAM guard's arithmetic
  (and whether it clamps) is the same on every machine.
- `--memory-limit`: psutil reports that many bytes available less the weights of every engine
  still alive (a model's memory is taken while it is loaded and given back once it is unloaded
  and collected), so a model pool's evictions are the same on every machine.
- `--script`: the engine is wrapped in `ScriptedEngine`, which makes the model say what the JSON
  `Script` in FILE says (tests/engine_proxies.py).
- `--record`: every request's method, path, headers and JSON body is appended to FILE as one JSON
  line, so a test can assert on what a real client sent.
- `--drafts-always-pay`: speculation's cost gate is pinned open, so which drafts are verified
  depends on the drafter alone, not on this machine's pass timings (repeatable counts).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Hooks:
    """What a test asks of `start_server(..., hooks=Hooks(...))`."""

    fault_marker: str | None = None
    available_memory: int | None = None  # bytes
    memory_limit: int | None = None  # bytes, less the weights of the engines alive
    script: Path | None = None
    record: Path | None = None
    drafts_always_pay: bool = False

    def argv(self) -> list[str]:
        out = ["--drafts-always-pay"] if self.drafts_always_pay else []
        for flag, value in (("--fault-marker", self.fault_marker), ("--available-memory", self.available_memory),
                            ("--memory-limit", self.memory_limit), ("--script", self.script),
                            ("--record", self.record)):
            if value is not None:
                out += [flag, str(value)]
        return out


class RequestRecorder:
    """ASGI middleware: one JSON line per HTTP request (method, path, headers, body) in `path`."""

    def __init__(self, app: Callable, path: Path) -> None:
        self.app, self.path, self._lock = app, path, threading.Lock()

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []

        async def recording_receive() -> dict[str, Any]:
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
                if not message.get("more_body"):
                    self._write(scope, b"".join(chunks))
            return message

        await self.app(scope, recording_receive, send)

    def _write(self, scope: dict[str, Any], body: bytes) -> None:
        try:
            parsed: Any = json.loads(body) if body else None
        except ValueError:
            parsed = body.decode("utf-8", "replace")
        line = json.dumps({"method": scope["method"], "path": scope["path"],
                           "headers": {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]},
                           "body": parsed})
        with self._lock, self.path.open("a") as f:
            f.write(line + "\n")


def install(hooks: Hooks) -> None:
    """Put the hooks in place in this process."""
    if hooks.drafts_always_pay:
        from lmserve.serving.speculate import PassCosts

        PassCosts.pays = lambda self, drafters, drafts, positions=0: True
    if hooks.available_memory is not None:
        import psutil

        real, available = psutil.virtual_memory, hooks.available_memory
        psutil.virtual_memory = lambda: real()._replace(available=available)
    alive: weakref.WeakSet = weakref.WeakSet()
    if hooks.memory_limit is not None:
        import psutil

        real, limit = psutil.virtual_memory, hooks.memory_limit
        psutil.virtual_memory = lambda: real()._replace(available=limit - sum(e.weight_bytes for e in list(alive)))
    if hooks.fault_marker is not None or hooks.script is not None or hooks.memory_limit is not None:
        from lmserve.engine import select
        from lmserve.model.tokenizer import Tokenizer
        from tests.engine_proxies import FaultyEngine, Script, ScriptedEngine

        real_load = select.load_engine

        def load_engine(kind, gguf, config, progress=None, kv_type="auto", cpu_dots="auto"):
            engine = real_load(kind, gguf, config, progress, kv_type, cpu_dots)
            tokenizer = Tokenizer.from_gguf(gguf)
            alive.add(engine)
            if hooks.script is not None:
                engine = ScriptedEngine(engine, tokenizer, Script.load(hooks.script))
            if hooks.fault_marker is not None:
                engine = FaultyEngine(engine, tokenizer.decode, hooks.fault_marker)
            return engine

        select.load_engine = load_engine  # lmserve.cli.serve imports it when it runs
    if hooks.record is not None:
        from lmserve.http import app

        real_app, record = app.server_app, hooks.record

        def server_app(*args, **kwargs):
            return RequestRecorder(real_app(*args, **kwargs), record)

        app.server_app = server_app


def main(argv: list[str]) -> None:
    ours, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="python -m tests.hooked_server")
    parser.add_argument("--fault-marker", default=None)
    parser.add_argument("--available-memory", type=int, default=None)
    parser.add_argument("--memory-limit", type=int, default=None)
    parser.add_argument("--script", type=Path, default=None)
    parser.add_argument("--record", type=Path, default=None)
    parser.add_argument("--drafts-always-pay", action="store_true")
    args = parser.parse_args(ours)
    install(Hooks(args.fault_marker, args.available_memory, args.memory_limit, args.script, args.record,
                  args.drafts_always_pay))
    from lmserve.cli import main as lmserve_main

    lmserve_main(rest)


if __name__ == "__main__":
    main(sys.argv[1:])
