"""Real engines wrapped for tests: each proxy sees what was fed into every cache and may replace the
rows a step returns. The scheduler, sampling, template, reply router and HTTP above them are real.

- `FaultyEngine`: a marked request fails at its third generated token (tests/test_faults.py).
- `ScriptedEngine`: logits masked so that the sampled tokens spell a scripted reply, for agent
  clients (Claude Code, Codex) whose tool round trips a tiny random-weight model would never make.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lmserve.engine.protocol import C, Engine
from lmserve.model.tokenizer import Tokenizer


@dataclass
class _Held:
    """What the proxy saw fed into one cache (None: positions restored from a file)."""

    tokens: list[int | None] = field(default_factory=list)
    prompt: int = 0  # positions held when it was last prefilled: the prompt of the reply under way
    decodes: int = 0  # positions decoded since then (a verify pass decodes several; truncating drops them)
    reply: list[int] = field(default_factory=list)  # ScriptedEngine: the ids this reply must spell
    resync: tuple[list[int], int] | None = None  # ScriptedEngine: the rule's resync ids, where they end in `reply`

    def prompt_ids(self) -> list[int]:
        return [t for t in self.tokens[:self.prompt] if t is not None]


class TrackingEngine(Engine[C]):
    """The real engine, passing every call through while keeping `_Held` per cache. Subclasses
    override `after_prefill` / `after_decode` / `after_verify` to replace what a step returns."""

    def __init__(self, engine: Engine[C]) -> None:
        self.engine = engine
        self.config, self.name, self.device = engine.config, engine.name, engine.device
        self.weight_bytes, self.kv_dtype_bytes = engine.weight_bytes, engine.kv_dtype_bytes
        self.kv_type, self.state_dtype_bytes = engine.kv_type, engine.state_dtype_bytes
        self.quant_summary, self.device_argmax = engine.quant_summary, engine.device_argmax
        self.cheap_verify = engine.cheap_verify
        self._held: weakref.WeakKeyDictionary[C, _Held] = weakref.WeakKeyDictionary()

    @property
    def checkpoints_per_cache(self) -> int:  # the runtime sets it on the proxy: the real engine makes the caches
        return self.engine.checkpoints_per_cache

    @checkpoints_per_cache.setter
    def checkpoints_per_cache(self, n: int) -> None:
        self.engine.checkpoints_per_cache = n

    def held(self, cache: C) -> _Held:
        return self._held.setdefault(cache, _Held())

    def after_prefill(self, held: _Held, logits: np.ndarray) -> np.ndarray:
        return logits

    def after_decode(self, helds: list[_Held], rows: np.ndarray, argmax: bool) -> np.ndarray:
        return rows

    def after_verify(self, held: _Held, first: int, rows: np.ndarray) -> np.ndarray:
        """One sequence's rows of a verify pass; row i is its decode number `first + i`."""
        return rows

    def new_cache(self, capacity: int) -> C:
        return self.engine.new_cache(capacity)

    def prefill(self, cache: C, token_ids: Sequence[int], all_logits: bool = False) -> np.ndarray:
        return self._prefilled(cache, token_ids, self.engine.prefill(cache, token_ids, all_logits))

    def prefill_together(self, caches: Sequence[C], token_ids: Sequence[Sequence[int]]) -> np.ndarray:
        rows = self.engine.prefill_together(caches, token_ids)
        return np.stack([self._prefilled(cache, ids, logits) for cache, ids, logits in zip(caches, token_ids, rows, strict=True)])

    def _prefilled(self, cache: C, token_ids: Sequence[int], logits: np.ndarray) -> np.ndarray:
        held = self.held(cache)
        held.tokens += [int(t) for t in token_ids]
        held.prompt, held.decodes = len(held.tokens), 0
        return self.after_prefill(held, logits)

    def embed(self, token_ids: Sequence[int]) -> np.ndarray:
        return self.engine.embed(token_ids)  # a pass on a cache of its own: nothing held changes

    def decode(self, caches: Sequence[C], token_ids: Sequence[int]) -> np.ndarray:
        return self.after_decode(self._step(caches, token_ids), self.engine.decode(caches, token_ids), False)

    def decode_argmax(self, caches: Sequence[C], token_ids: Sequence[int]) -> np.ndarray:
        return self.after_decode(self._step(caches, token_ids), self.engine.decode_argmax(caches, token_ids), True)

    def verify(self, caches: Sequence[C], token_ids: Sequence[Sequence[int]]) -> list[np.ndarray]:
        rows = self.engine.verify(caches, token_ids)
        out = []
        for cache, ids, logits in zip(caches, token_ids, rows, strict=True):
            held = self.held(cache)
            first = held.decodes + 1
            held.tokens += [int(t) for t in ids]
            held.decodes += len(ids)
            out.append(self.after_verify(held, first, logits))
        return out

    def _step(self, caches: Sequence[C], token_ids: Sequence[int]) -> list[_Held]:
        helds = []
        for cache, token in zip(caches, token_ids, strict=True):
            held = self.held(cache)
            held.tokens.append(int(token))
            held.decodes += 1
            helds.append(held)
        return helds

    def truncate(self, cache: C, n: int) -> None:
        self.engine.truncate(cache, n)
        held = self.held(cache)
        del held.tokens[n:]
        held.decodes = max(0, min(held.decodes, n - held.prompt))  # rejected drafts are not decoded

    def copy_prefix(self, src: C, dst: C, n: int) -> None:
        self.engine.copy_prefix(src, dst, n)
        self._held[dst] = _Held(self.held(src).tokens[:n])

    def resume_point(self, cache: C, n: int) -> int:
        return self.engine.resume_point(cache, n)

    def checkpoint(self, cache: C) -> None:
        self.engine.checkpoint(cache)

    def save_cache(self, cache: C, path: Path) -> None:
        self.engine.save_cache(cache, path)

    def load_cache(self, path: Path, capacity: int) -> C:
        cache = self.engine.load_cache(path, capacity)
        self._held[cache] = _Held([None] * cache.length)
        return cache


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


class FaultyEngine(TrackingEngine[C]):
    """The real engine, except that a marked request's third generated token fails.

    The scheduler samples token 1 from the prefill's logits and token n from the (n-1)th decode
    step's, so the row of a marked prompt's second decode step is replaced by a `_FaultRow`."""

    def __init__(self, engine: Engine[C], decode_text: Callable[[list[int]], str], marker: str) -> None:
        super().__init__(engine)
        self.decode_text, self.marker = decode_text, marker

    def after_decode(self, helds: list[_Held], rows: np.ndarray, argmax: bool) -> np.ndarray:
        faulty = [i for i, held in enumerate(helds)
                  if held.decodes == 2 and self.marker in self.decode_text(held.prompt_ids())]
        if not faulty:
            return rows
        out = np.empty(len(rows), dtype=object)
        for i, row in enumerate(rows):
            out[i] = _FaultRow(InjectedFault("injected test fault")) if i in faulty else row
        return out

    def after_verify(self, held: _Held, first: int, rows: np.ndarray) -> np.ndarray:
        if not first <= 2 < first + len(rows) or self.marker not in self.decode_text(held.prompt_ids()):
            return rows
        out = list(rows)
        out[2 - first] = _FaultRow(InjectedFault("injected test fault"))
        return out


@dataclass(frozen=True)
class Rule:
    """Reply `reply` (raw model text: tool-call markup included) to a prompt containing `after`.
    With `resync`, the reply is `reply`, `resync`, `then`: once the tokens of `resync` have been
    fed (the server forced them: a think block closed over budget), the script goes on with `then`
    wherever the reply was, so a model that would reason forever still answers after the close."""

    after: str
    reply: str
    resync: str = ""
    then: str = ""


@dataclass(frozen=True)
class Script:
    """What the scripted model says. For each request the rule whose `after` text occurs latest in
    the rendered prompt wins (so a follow-up turn that carries a tool's output picks the rule keyed on
    that output); a prompt that contains none gets `default`."""

    rules: tuple[Rule, ...]
    default: str = "OK."

    def rule_for(self, prompt: str) -> Rule:
        best, where = Rule("", self.default), -1
        for rule in self.rules:
            at = prompt.rfind(rule.after)
            if at > where:
                best, where = rule, at
        return best

    def dump(self, path: Path) -> None:
        path.write_text(json.dumps({"rules": [vars(r) for r in self.rules], "default": self.default}))

    @classmethod
    def load(cls, path: Path) -> Script:
        data = json.loads(path.read_text())
        return cls(tuple(Rule(**r) for r in data["rules"]), data.get("default", "OK."))


class ScriptedEngine(TrackingEngine[C]):
    """The real engine with each row's logits masked to one token: the next of the scripted reply
    chosen at the prompt's prefill, then an end-of-turn token. Nothing else differs from serving."""

    def __init__(self, engine: Engine[C], tokenizer: Tokenizer, script: Script) -> None:
        super().__init__(engine)
        self.tokenizer, self.script = tokenizer, script
        end = tokenizer.eos_id if tokenizer.eos_id in tokenizer.eog_ids else min(tokenizer.eog_ids)
        self._end = end

    def _forced(self, held: _Held, at: int | None = None) -> int:
        """The scripted token of decode number `at` (default: the latest decode step's)."""
        reply = held.reply or [self._end]
        at = held.decodes if at is None else at
        if held.resync is not None:
            marker, resume = held.resync
            fed = held.tokens[held.prompt:held.prompt + at]
            ends = [i + len(marker) for i in range(len(fed) - len(marker) + 1) if fed[i:i + len(marker)] == marker]
            if ends:
                at = resume + at - ends[-1]
        return reply[min(at, len(reply) - 1)]

    def _only(self, row: np.ndarray, token: int) -> np.ndarray:
        out = np.full_like(row, -1e9)
        out[token] = 0.0
        return out

    def after_prefill(self, held: _Held, logits: np.ndarray) -> np.ndarray:
        rule = self.script.rule_for(self.tokenizer.decode(held.prompt_ids()))
        parts = [self.tokenizer.encode(text, add_special=False) for text in (rule.reply, rule.resync, rule.then)]
        held.reply = [*parts[0], *parts[1], *parts[2], self._end]
        held.resync = (parts[1], len(parts[0]) + len(parts[1])) if rule.resync else None
        token = self._forced(held)
        if logits.ndim == 2:
            logits = logits.copy()
            logits[-1] = self._only(logits[-1], token)
            return logits
        return self._only(logits, token)

    def after_decode(self, helds: list[_Held], rows: np.ndarray, argmax: bool) -> np.ndarray:
        forced = [self._forced(held) for held in helds]
        if argmax:
            return np.asarray(forced, dtype=np.int64)
        return np.stack([self._only(row, token) for row, token in zip(rows, forced, strict=True)])

    def after_verify(self, held: _Held, first: int, rows: np.ndarray) -> np.ndarray:
        return np.stack([self._only(row, self._forced(held, first + i)) for i, row in enumerate(rows)])
