"""Resident KV slots reused across requests: continuation, prefix sharing, LRU reset.

The APIs are stateless, but agent clients resend the same system prompt, tools and history every
turn. Each slot keeps a KV cache and the token ids it holds, so a request that continues a slot
(or shares a prefix with one) only prefills what is new.

Choice for a prompt P among idle slots (as llama.cpp, plus a donor-preserving copy):
- the slot whose tokens are a prefix of P, or the same session's slot: adopted in place, truncated
  to the common prefix (a rewind) before the rest of P is prefilled;
- a slot that merely shares a prefix (same system prompt, other dialogue) at or above the
  similarity gate: its first rows are copied into another slot; the donor stays intact;
- a file in the disk tier that matches better than every resident slot is restored;
- otherwise the least recently used slot is reset (spilled to disk first when a tier exists).

A hybrid model's cache (Qwen3.5's recurrent layers) cuts back exactly only to its checkpoints, so a
shared prefix counts up to the engine's `resume_point` for it: the latest checkpoint at or below
the common prefix, whose rest is then prefilled like the new part of the prompt.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from lmserve.engine.protocol import Engine, KVCache
from lmserve.serving.kv_disk import DiskTier

log = logging.getLogger("lmserve.kv")

SIMILARITY_GATE = 0.1  # share of the prompt a prefix must cover to be reused (llama.cpp's value)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass
class Slot:
    index: int
    cache: KVCache
    tokens: list[int] = field(default_factory=list)  # ids whose keys/values the cache holds
    session_id: str | None = None
    last_used: int = 0
    busy: bool = False


@dataclass(frozen=True)
class Adoption:
    """What `acquire` did: the slot to use and how many prompt tokens it already holds."""

    slot: Slot
    reused: int
    how: str  # "continue", "rewind", "copy", "disk", "reset"


class SlotPool:
    """A fixed number of KV slots, each allocated lazily by the engine as it fills."""

    def __init__(self, engine: Engine, n_slots: int, ctx: int, disk: DiskTier | None = None,
                 reuse: bool = True) -> None:
        self.engine = engine
        self.ctx = ctx
        self.disk = disk
        self.reuse = reuse  # False (--no-kv-reuse): every prompt is prefilled whole, to measure what reuse saves
        self._clock = itertools.count(1)
        self.slots = [Slot(i, engine.new_cache(ctx)) for i in range(max(1, n_slots))]

    # -- choosing ----------------------------------------------------------------------------

    def acquire(self, prompt: list[int], session_id: str | None = None) -> Adoption | None:
        """Pick and prepare an idle slot for `prompt`; None when every slot is busy.
        At least the prompt's last token is always left to prefill (its logits are needed)."""
        idle = [s for s in self.slots if not s.busy]
        if not idle:
            return None
        limit = len(prompt) - 1
        if not self.reuse:
            target = self._victim(idle)
            self._evict(target)
            return self._adopt(target, 0, session_id, "reset")

        def score(s: Slot) -> tuple[int, bool, int]:
            """Longest reusable prefix first; the same session, then recency, break ties."""
            same = session_id is not None and s.session_id == session_id
            return (self._reusable(s.cache, min(common_prefix(s.tokens, prompt), limit)), same, s.last_used)

        best = max(idle, key=score)
        shared = score(best)[0]
        same_session = session_id is not None and best.session_id == session_id
        on_disk = self.disk.best_match(prompt) if self.disk else None
        if on_disk is not None and min(on_disk.shared, limit) > shared:
            return self._restore(idle, best, on_disk, prompt, session_id)
        if shared and (shared == len(best.tokens) or same_session):
            return self._adopt(best, shared, session_id, "continue" if shared == len(best.tokens) else "rewind")
        if shared and shared >= SIMILARITY_GATE * len(prompt):
            target = self._victim(idle, exclude=best)
            if target is None:  # no other slot: the donor's own dialogue is given up (kept on disk)
                self._spill(best)
                return self._adopt(best, shared, session_id, "rewind")
            self._evict(target)
            self.engine.copy_prefix(best.cache, target.cache, shared)
            target.tokens = best.tokens[:shared]
            return self._adopt(target, shared, session_id, "copy")
        target = self._victim(idle)
        self._evict(target)
        return self._adopt(target, 0, session_id, "reset")

    def _restore(self, idle: list[Slot], best: Slot, entry, prompt: list[int],
                 session_id: str | None) -> Adoption:
        target = self._victim(idle)
        self._evict(target)
        cache = self.disk.load(entry, self.engine, self.ctx)
        if cache is None:  # unreadable after all: skip it, fall back to a cold prefill
            return self._adopt(target, 0, session_id, "reset")
        target.cache, target.tokens = cache, list(entry.tokens)
        shared = self._reusable(cache, min(entry.shared, len(prompt) - 1))
        return self._adopt(target, shared, session_id, "disk")

    def _reusable(self, cache: KVCache, shared: int) -> int:
        """How much of a shared prefix of `shared` positions is reused: all of it, or for a hybrid
        cache up to its latest checkpoint (`Engine.resume_point`)."""
        return self.engine.resume_point(cache, shared) if shared else 0

    @staticmethod
    def _victim(idle: list[Slot], exclude: Slot | None = None) -> Slot | None:
        """An empty idle slot if any, else the least recently used one."""
        candidates = [s for s in idle if s is not exclude]
        if not candidates:
            return None
        return min(candidates, key=lambda s: (bool(s.tokens), s.last_used))

    def _spill(self, slot: Slot) -> None:
        if self.disk is not None and slot.tokens:
            self.disk.spill(slot.cache, slot.tokens, self.engine)

    def _evict(self, slot: Slot) -> None:
        """Forget a slot's contents, spilling them to the disk tier first when one exists."""
        self._spill(slot)
        self.engine.truncate(slot.cache, 0)
        slot.tokens = []
        slot.session_id = None

    def _adopt(self, slot: Slot, shared: int, session_id: str | None, how: str) -> Adoption:
        if slot.cache.length > shared:
            self.engine.truncate(slot.cache, shared)
        del slot.tokens[shared:]
        slot.busy = True
        slot.session_id = session_id or slot.session_id
        slot.last_used = next(self._clock)
        return Adoption(slot, shared, how)

    # -- giving back -------------------------------------------------------------------------

    def release(self, slot: Slot, tokens: Sequence[int]) -> None:
        """Return a slot; `tokens` are the ids fed through it (the cache holds their first
        `cache.length`). A slot whose cache no longer matches is emptied instead."""
        n = slot.cache.length
        slot.tokens = list(tokens[:n]) if len(tokens) >= n else []
        if not slot.tokens:
            self.engine.truncate(slot.cache, 0)
        slot.busy = False
        slot.last_used = next(self._clock)

    def spill_all(self) -> None:
        """On shutdown: keep every idle slot's contents on disk for the next start."""
        for slot in self.slots:
            if not slot.busy:
                self._spill(slot)

    def stats(self) -> dict:
        return {
            "slots": len(self.slots),
            "in_use": sum(s.busy for s in self.slots),
            "tokens": [len(s.tokens) for s in self.slots],
            "kv_bytes": sum(s.cache.nbytes for s in self.slots),
            "disk_files": len(self.disk) if self.disk else 0,
        }
