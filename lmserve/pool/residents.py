"""The models resident at once: loaded on demand by name, unloaded under the RAM guard.

Each resident model has its own Runtime (engine, KV slots, scheduler thread), so batching within a
model is as before and two models may decode at once (they share the cores or the GPU's bandwidth;
docs/LMSERVER.md says why this over one worker for all). The startup model stays resident; a model
loaded by name stays until it has been idle `--keep-alive`, or until another needs its room.

Loading one that would not fit (`--max-models`, or its estimated bytes against the memory
available) first unloads the least recently used idle models, never one with a request in flight
(queued, admitted, generating, or between its parsing and its queueing: a lease); their KV slots
go to the disk tier when one is set. Requests for a model being loaded wait for that load; loads
run one at a time, off the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import psutil

from lmserve.core.errors import RequestError
from lmserve.model.gguf_file import ModelLoadError
from lmserve.pool.directory import ModelChoice, ModelDirectory
from lmserve.runtime import Runtime, shutting_down
from lmserve.serving.ram_guard import MemoryRefusal

log = logging.getLogger("lmserve.models")
# What loading a model is priced at before it is loaded, as a multiple of its file: weights about
# the file's size (MLX; the NumPy engine's kept quants 1.1-1.3x for the usual types), and room for
# its first KV slots; the engine's own check still refuses what does not fit after all.
LOAD_COST = 1.3
WAIT_STEP = 0.1  # seconds between looks for a model that has become idle, when all are busy


@dataclass
class Resident:
    """A loaded model and what the pool knows of its use."""

    choice: ModelChoice
    runtime: Runtime
    pinned: bool = False  # the startup model: never unloaded
    load_seconds: float = 0.0
    leases: int = 0  # requests between choosing this model and queueing their job
    keep_alive: float | None = None  # a request's own (Ollama's keep_alive) over --keep-alive
    last_used: float = field(default_factory=time.monotonic)

    @property
    def busy(self) -> bool:
        return self.leases > 0 or self.runtime.busy

    @property
    def bytes(self) -> int:
        """What unloading it gives back, at most."""
        return self.runtime.footprint()

    def describe(self) -> dict[str, Any]:
        status = self.runtime.status()
        return {"id": self.runtime.model.model_id, "path": str(self.runtime.model.path), "pinned": self.pinned,
                "busy": self.busy, "queue_depth": status.queue_depth, "active_sequences": status.active_sequences,
                "weight_bytes": self.runtime.engine.weight_bytes, "kv_bytes": status.kv["kv_bytes"],
                "kv_bytes_reserved": self.bytes - self.runtime.engine.weight_bytes, "context": self.runtime.ctx,
                "idle_seconds": round(time.monotonic() - self.last_used, 1), "load_seconds": round(self.load_seconds, 2)}


class ModelPool:
    """Resident runtimes by model; `opener` loads and starts one (blocking, off the event loop)."""

    def __init__(self, default: Runtime, directory: ModelDirectory, opener: Callable[[ModelChoice], Runtime],
                 max_models: int = 0, keep_alive: float = 300.0, available: Callable[[], int] | None = None) -> None:
        self.directory = directory
        self.default = default
        self.max_models = max_models
        self.keep_alive = keep_alive
        self._opener = opener
        self._available = available or (lambda: psutil.virtual_memory().available)
        self._residents: dict[str, Resident] = {directory.default.key: Resident(directory.default, default, pinned=True)}
        self._loading: dict[str, asyncio.Future[Resident]] = {}
        self._load_lock: asyncio.Lock | None = None
        self._sweeper: asyncio.Task | None = None  # started with the first model loaded by name
        self.loads = 0  # models loaded by name since the start
        self.unloads = 0

    # -- requests --------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def use(self, name: str | None) -> AsyncIterator[Runtime]:
        """The runtime serving `name` (loaded first if need be), leased for the block: it is not
        unloaded before the request's job is queued (from then on the job itself keeps it)."""
        # Only a name other than the startup model's may need the stores scanned: off the loop.
        choice = self.directory.default if not name else await asyncio.to_thread(self.directory.find, name)
        resident = await self.resident(choice)
        resident.leases += 1
        try:
            yield resident.runtime
        finally:
            resident.leases -= 1
            resident.last_used = time.monotonic()

    async def resident(self, choice: ModelChoice) -> Resident:
        """`choice` loaded: resident already, or loaded now (a load underway is waited for)."""
        while True:
            found = self._residents.get(choice.key)
            if found is not None:
                found.last_used = time.monotonic()
                return found
            if self.draining:
                raise shutting_down()
            loading = self._loading.get(choice.key)
            if loading is None:
                loading = asyncio.ensure_future(self._load(choice))
                self._loading[choice.key] = loading
                loading.add_done_callback(lambda _, key=choice.key: self._loading.pop(key, None))
            await asyncio.shield(loading)

    @property
    def draining(self) -> bool:
        return self.default.draining

    # -- loading and unloading -------------------------------------------------------------------

    async def _load(self, choice: ModelChoice) -> Resident:
        self._load_lock = self._load_lock or asyncio.Lock()
        async with self._load_lock:
            if await self._make_room(choice):
                await asyncio.to_thread(gc.collect)  # what was unloaded is gone before the next loads
            started = time.monotonic()
            log.info("loading %s (%s)", choice.name, choice.path)
            try:
                runtime = await asyncio.to_thread(self._opener, choice)
            except (ModelLoadError, MemoryRefusal, OSError) as exc:
                raise RequestError(f"model {choice.name!r} cannot be loaded: {exc}", 503, "model",
                                   "model_load_failed") from None
            resident = Resident(choice, runtime, load_seconds=time.monotonic() - started)
            self._residents[choice.key] = resident
            self.loads += 1
            if self._sweeper is None and not math.isinf(self.keep_alive):
                self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
            log.info("loaded %s in %.1f s", choice.name, resident.load_seconds)
            return resident

    async def _make_room(self, choice: ModelChoice) -> bool:
        """Unload idle models, least recently used first, until `choice` fits by count and by its
        estimated bytes; with every model busy, wait for one (a count that must shrink) or try
        anyway (bytes: the engine's own check decides). Whether any was unloaded."""
        need = LOAD_COST * _file_bytes(choice)
        free = self._available()
        unloaded = False
        while True:
            crowded = 0 < self.max_models <= len(self._residents)
            if not crowded and need <= free:
                return unloaded
            key = self._least_recently_used_idle()
            if key is None:
                if not crowded:
                    return unloaded
                await asyncio.sleep(WAIT_STEP)
                continue
            free += await self.unload(key)
            unloaded = True

    def _least_recently_used_idle(self) -> str | None:
        idle = [r for r in self._residents.values() if not r.pinned and not r.busy]
        return min(idle, key=lambda r: r.last_used).choice.key if idle else None

    async def unload(self, key: str) -> int:
        """Stop a model's worker (its idle KV slots spilled to the disk tier) and let it go; the
        bytes it held. Only the key is passed in and kept here, so that nothing refers to the
        runtime once this returns (the collector frees its engine at the next collection)."""
        resident = self._residents.pop(key)
        log.info("unloading %s (idle %.0f s)", resident.choice.name, time.monotonic() - resident.last_used)
        held, runtime = resident.bytes, resident.runtime
        del resident
        await asyncio.to_thread(_close, runtime)
        self.unloads += 1
        return held

    async def load(self, name: str) -> Resident:
        """Load a model by name ahead of its requests (POST /models/load)."""
        return await self.resident(self.directory.find(name, hosted_is_default=False))

    async def unload_named(self, name: str) -> bool:
        """Unload a model by name when it is resident and idle; False when it is not resident.
        RequestError 409 while it has requests, or for the startup model."""
        key = self.directory.find(name, hosted_is_default=False).key
        if key not in self._residents:
            return False
        if self._residents[key].pinned:
            raise RequestError("the model the server started with stays loaded", 409, "model", "model_pinned")
        if self._residents[key].busy:
            raise RequestError(f"model {name!r} has requests in flight; unload it when they end", 409, "model",
                               "model_busy")
        await self.unload(key)
        await asyncio.to_thread(gc.collect)
        return True

    async def _sweep(self) -> None:
        """Unload models idle longer than --keep-alive, for as long as the server runs."""
        while True:
            await asyncio.sleep(min(1.0, max(self.keep_alive / 4, 0.05)))
            now = time.monotonic()
            expired = [key for key, r in self._residents.items()
                       if not r.pinned and not r.busy and now - r.last_used >= self.kept_for(r)]
            for key in expired:
                if key in self._residents:
                    await self.unload(key)
            if expired:
                await asyncio.to_thread(gc.collect)

    def kept_for(self, resident: Resident) -> float:
        """Seconds an idle model stays: its last request's keep-alive, else --keep-alive."""
        return self.keep_alive if resident.keep_alive is None else resident.keep_alive

    def keep(self, runtime: Runtime, seconds: float) -> None:
        """A request's keep-alive for its model (the startup model stays whatever it says)."""
        for resident in self._residents.values():
            if resident.runtime is runtime:
                resident.keep_alive = seconds
        if self._sweeper is None and not math.isinf(seconds):
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    # -- what the routes report ------------------------------------------------------------------

    def residents(self) -> list[Resident]:
        return list(self._residents.values())

    def is_loaded(self, choice: ModelChoice) -> bool:
        return choice.key in self._residents

    def runtimes(self) -> list[Runtime]:
        return [r.runtime for r in self._residents.values()]

    def request_stop(self) -> None:
        for runtime in self.runtimes():
            runtime.request_stop()

    def stop(self) -> None:
        for runtime in self.runtimes():
            runtime.stop()


def _file_bytes(choice: ModelChoice) -> int:
    try:
        return choice.path.stat().st_size
    except OSError:
        return 0


def _close(runtime: Runtime) -> None:
    runtime.stop()
    runtime.model.gguf.close()
