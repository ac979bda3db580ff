"""One inference worker that owns the engine, fed by a bounded queue, with continuous batching.

Connection handlers submit jobs; the worker thread admits them (prefill) up to `max_batch`
active sequences and decodes all active sequences together, one engine step per token.
A job arriving while a batch runs is prefilled between two steps and joins the next one.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from lmserve.core.events import Failed, Finished, Usage
from lmserve.core.token_stream import TokenStream
from lmserve.engine.jobs import GenerationJob
from lmserve.engine.protocol import Engine, KVCache
from lmserve.engine.sampling import Sampler, token_logprob
from lmserve.model.tokenizer import Tokenizer

log = logging.getLogger("lmserve.scheduler")


class QueueFull(Exception):
    """The bounded queue has no free place; the caller answers 429."""


@dataclass
class _Sequence:
    """A job being decoded: its cache, sampler, text state and last sampled token."""

    job: GenerationJob
    cache: KVCache
    sampler: Sampler
    stream: TokenStream
    last_token: int = -1
    generated: int = 0
    cached_tokens: int = 0


class Scheduler:
    """Bounded queue + single worker thread + continuous batching over one engine."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer,
        ctx: int,
        max_queue: int = 16,
        max_batch: int = 1,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.ctx = ctx
        self.max_queue = max_queue
        self.max_batch = max(1, max_batch)
        self.tokens_generated = 0  # every token the engine produced, for tests and metrics
        self._queue: deque[GenerationJob] = deque()
        self._active: list[_Sequence] = []
        self._cv = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="lmserve-worker", daemon=True)
        self._device_argmax: Callable | None = getattr(engine, "decode_argmax", None)

    # -- connection side ---------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def request_stop(self) -> None:
        """Stop after the current step: queued and active jobs end with a terminal error event.
        Safe to call from a signal handler; returns at once."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()

    def stop(self, timeout: float = 5.0) -> None:
        self.request_stop()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def submit(self, job: GenerationJob) -> None:
        with self._cv:
            if self._stopping:
                raise QueueFull("server is shutting down")
            if len(self._queue) >= self.max_queue:
                raise QueueFull(f"the request queue is full ({self.max_queue} waiting)")
            self._queue.append(job)
            self._cv.notify()

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def active_sequences(self) -> int:
        return len(self._active)

    # -- worker side -------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and not self._queue and not self._active:
                    self._cv.wait()
                if self._stopping:
                    break
                admit = []
                while self._queue and len(self._active) + len(admit) < self.max_batch:
                    admit.append(self._queue.popleft())
            for job in admit:
                self._admit(job)
            if self._active:
                self._step()
        self._shutdown()

    def _shutdown(self) -> None:
        with self._cv:
            pending = list(self._queue) + [seq.job for seq in self._active]
            self._queue.clear()
            self._active.clear()
        for job in pending:
            job.emit(Failed("the server is shutting down", 503, "overloaded_error"))

    def _admit(self, job: GenerationJob) -> None:
        if job.cancelled.is_set():
            return
        try:
            cache = self.engine.new_cache(self.ctx)
            logits = self.engine.prefill(cache, job.prompt_ids)
            seq = _Sequence(job, cache, Sampler(job.sampling, job.prompt_ids),
                            TokenStream(self.tokenizer.token_bytes, job.stop))
            if not self._advance(seq, logits=logits):
                self._active.append(seq)
        except Exception as exc:  # one request's failure never takes the worker down
            log.exception("prefill failed")
            job.emit(Failed(f"generation failed: {exc}"))

    def _step(self) -> None:
        self._active = [s for s in self._active if not s.job.cancelled.is_set()]
        if not self._active:
            return
        caches = [s.cache for s in self._active]
        tokens = [s.last_token for s in self._active]
        try:
            if self._device_argmax and not any(s.job.sampling.needs_host_logits for s in self._active):
                ids = self._device_argmax(caches, tokens)
                finished = [self._advance(s, token=int(t)) for s, t in zip(self._active, ids, strict=True)]
            else:
                logits = self.engine.decode(caches, tokens)
                finished = [self._advance(s, logits=row) for s, row in zip(self._active, logits, strict=True)]
        except Exception as exc:
            log.exception("decode step failed")
            for seq in self._active:
                seq.job.emit(Failed(f"generation failed: {exc}"))
            self._active = []
            return
        self._active = [s for s, done in zip(self._active, finished, strict=True) if not done]

    def _advance(self, seq: _Sequence, logits: np.ndarray | None = None, token: int | None = None) -> bool:
        """Sample (unless the device already did), stream the token; True when the job is over."""
        job = seq.job
        if token is None:
            token, adjusted = seq.sampler.sample(logits)
        else:
            seq.sampler.accept(token)
            adjusted = None
        self.tokens_generated += 1
        seq.generated += 1
        if token in self.tokenizer.eog_ids:
            return self._finish(seq, "stop")
        lp = None
        if job.sampling.logprobs and adjusted is not None:
            lp = token_logprob(adjusted, token, job.sampling.top_logprobs,
                               self.tokenizer.piece, self.tokenizer.token_bytes)
        delta = seq.stream.push(token, lp)
        if delta is not None:
            job.emit(delta)
        if seq.stream.stopped:
            return self._finish(seq, "stop")
        seq.last_token = token
        if seq.generated >= job.max_tokens or seq.cache.length >= self.ctx:
            return self._finish(seq, "length")
        return False

    def _finish(self, seq: _Sequence, reason: str) -> bool:
        tail = seq.stream.flush()
        if tail is not None:
            seq.job.emit(tail)
        usage = Usage(len(seq.job.prompt_ids), seq.generated, seq.cached_tokens)
        seq.job.emit(Finished(reason, usage, seq.stream.stop_sequence))
        return True
