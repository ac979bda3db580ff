"""lmserve with test hooks that production code has no place for, started by tests/server_util.py:

    python -m tests.hooked_server [--fault-marker MARKER] [--available-memory BYTES] -- LMSERVE ARGS

Both hooks are installed here, around the real code, before `lmserve.cli.main(LMSERVE ARGS)` runs:

- `--fault-marker`: the engine is wrapped in `FaultyEngine`. A request whose prompt contains MARKER
  fails in the worker at its third generated token, after its reply has started streaming, and
  alone: the sequences decoded in the same step go on.
- `--available-memory`: psutil reports that many bytes available, so the RAM guard's arithmetic
  (and whether it clamps) is the same on every machine.
"""

from __future__ import annotations

import argparse
import sys
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lmserve.engine.protocol import C, Engine


@dataclass(frozen=True)
class Hooks:
    """What a test asks of `start_server(..., hooks=Hooks(...))`."""

    fault_marker: str | None = None
    available_memory: int | None = None  # bytes

    def argv(self) -> list[str]:
        out = []
        if self.fault_marker is not None:
            out += ["--fault-marker", self.fault_marker]
        if self.available_memory is not None:
            out += ["--available-memory", str(self.available_memory)]
        return out


class InjectedFault(RuntimeError):
    """The failure `FaultyEngine` plants in a marked request's row."""


class _FaultRow:
    """Stands in for one sequence's row of a decode step (logits or an id): its first use raises,
    so the scheduler fails that sequence alone, as it would one whose sampling failed."""

    def __init__(self, exc: Exception) -> None:
        self._exc = exc

    def _raise(self, *args, **kwargs):
        raise self._exc

    __array__ = __int__ = __index__ = __float__ = __getitem__ = __len__ = __iter__ = _raise

    def __getattr__(self, name: str):
        raise self._exc


@dataclass
class _Held:
    """What the proxy saw fed into one cache (None: positions restored from a file)."""

    tokens: list[int | None] = field(default_factory=list)
    prompt: int = 0  # positions held when it was last prefilled: the prompt of the reply under way
    decodes: int = 0  # decode steps since then


class FaultyEngine(Engine[C]):
    """The real engine, except that a marked request's third generated token fails.

    The scheduler samples token 1 from the prefill's logits and token n from the (n-1)th decode
    step's, so the row of a marked prompt's second decode step is replaced by a `_FaultRow`."""

    def __init__(self, engine: Engine[C], decode_text: Callable[[list[int]], str], marker: str) -> None:
        self.engine, self.decode_text, self.marker = engine, decode_text, marker
        self.config, self.name, self.device = engine.config, engine.name, engine.device
        self.weight_bytes, self.kv_dtype_bytes = engine.weight_bytes, engine.kv_dtype_bytes
        self.quant_summary, self.device_argmax = engine.quant_summary, engine.device_argmax
        self._held: weakref.WeakKeyDictionary[C, _Held] = weakref.WeakKeyDictionary()

    def _of(self, cache: C) -> _Held:
        return self._held.setdefault(cache, _Held())

    def new_cache(self, max_tokens: int) -> C:
        return self.engine.new_cache(max_tokens)

    def prefill(self, cache: C, token_ids: Sequence[int], all_logits: bool = False) -> np.ndarray:
        logits = self.engine.prefill(cache, token_ids, all_logits)
        held = self._of(cache)
        held.tokens += [int(t) for t in token_ids]
        held.prompt, held.decodes = len(held.tokens), 0
        return logits

    def decode(self, caches: Sequence[C], token_ids: Sequence[int]) -> np.ndarray:
        return self._plant(caches, token_ids, self.engine.decode(caches, token_ids))

    def decode_argmax(self, caches: Sequence[C], token_ids: Sequence[int]) -> np.ndarray:
        return self._plant(caches, token_ids, self.engine.decode_argmax(caches, token_ids))

    def _plant(self, caches: Sequence[C], token_ids: Sequence[int], rows: np.ndarray) -> np.ndarray:
        faulty = []
        for i, (cache, token) in enumerate(zip(caches, token_ids, strict=True)):
            held = self._of(cache)
            held.tokens.append(int(token))
            held.decodes += 1
            prompt = [t for t in held.tokens[:held.prompt] if t is not None]
            if held.decodes == 2 and self.marker in self.decode_text(prompt):
                faulty.append(i)
        if not faulty:
            return rows
        out = np.empty(len(rows), dtype=object)
        for i, row in enumerate(rows):
            out[i] = _FaultRow(InjectedFault("injected test fault")) if i in faulty else row
        return out

    def truncate(self, cache: C, n: int) -> None:
        self.engine.truncate(cache, n)
        del self._of(cache).tokens[n:]

    def copy_prefix(self, src: C, dst: C, n: int) -> None:
        self.engine.copy_prefix(src, dst, n)
        self._held[dst] = _Held(self._of(src).tokens[:n])

    def save_cache(self, cache: C, path: Path) -> None:
        self.engine.save_cache(cache, path)

    def load_cache(self, path: Path, max_tokens: int) -> C:
        cache = self.engine.load_cache(path, max_tokens)
        self._held[cache] = _Held([None] * cache.length)
        return cache


def install(hooks: Hooks) -> None:
    """Put the hooks in place in this process."""
    if hooks.available_memory is not None:
        import psutil

        real, available = psutil.virtual_memory, hooks.available_memory
        psutil.virtual_memory = lambda: real()._replace(available=available)
    if hooks.fault_marker is not None:
        from lmserve.engine import select
        from lmserve.model.tokenizer import Tokenizer

        real_load, marker = select.load_engine, hooks.fault_marker

        def load_engine(kind, gguf, config, progress=None):
            return FaultyEngine(real_load(kind, gguf, config, progress), Tokenizer.from_gguf(gguf).decode, marker)

        select.load_engine = load_engine  # lmserve.cli.serve imports it when it runs


def main(argv: list[str]) -> None:
    ours, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="python -m tests.hooked_server")
    parser.add_argument("--fault-marker", default=None)
    parser.add_argument("--available-memory", type=int, default=None)
    args = parser.parse_args(ours)
    install(Hooks(args.fault_marker, args.available_memory))
    from lmserve.cli import main as lmserve_main

    lmserve_main(rest)


if __name__ == "__main__":
    main(sys.argv[1:])
