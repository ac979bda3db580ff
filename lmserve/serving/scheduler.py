"""One inference worker that owns the engine, fed by a bounded queue, with continuous batching.

Connection handlers submit jobs; the worker thread admits them up to `max_batch` sequences and
decodes all running sequences together, one engine step per token. A job arriving while a batch
runs is prefilled in chunks of `prefill_chunk` tokens, one chunk between two decode steps, so a
long prompt never stalls the running streams for more than one chunk; it joins the batch once
its prompt is in the cache. With no stream decoding, chunks go up to LONE_PREFILL_CHUNK; a
prompt's chunks are evened out (the fewest of at most that size, `even_chunk`). A
cancelled job (client gone) is dropped from the queue at once and from the batch at the next step
or chunk, giving back its slot.

A hybrid model's cache (recurrent layers, `engine/checkpoints.py`) is checkpointed where a later
request may want to resume: after every prefill chunk, where the history ends (before the
template's generation prompt: the next turn's prompt renders this reply in its own way and parts
from this one there), and at the prompt's last two positions (its last token is prefilled alone:
a retry of the same prompt resumes there, since at least the last token is always prefilled).

With speculative decoding (serving/speculate.py) a step is a verify pass whenever a sequence has
a draft and the drafts are worth the pass (`PassCosts`, from the passes timed so far): each
sequence feeds its last token plus its draft (possibly none), picks from every position's logits
as a decode step would, keeps the draft up to the first disagreement and truncates its cache back
to the tokens taken. Every token still goes through `_emit` one by one, so stop strings,
grammars, logprobs and max_tokens see exactly what plain decoding shows them.

Work on the engine that is not a generation (embeddings) is a call (`call`): the worker runs it
between two steps, on its own thread (MLX's streams belong to the thread that made them), and
sets its future; one that was cancelled while waiting (its client left) is skipped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from lmserve.chat.reply import ReplyDecoder
from lmserve.core.events import Failed, Finished, Started
from lmserve.engine.chunks import even_chunk
from lmserve.engine.protocol import Engine
from lmserve.model.tokenizer import Tokenizer
from lmserve.serving.handle import SpeculationUsage
from lmserve.serving.jobs import GenerationJob
from lmserve.serving.kv_slots import Slot, SlotPool
from lmserve.serving.sampling import Sampler, token_logprob
from lmserve.serving.speculate import Drafter, DrafterFactory, PassCosts, PromptLookup

log = logging.getLogger("lmserve.scheduler")


PREFILL_CHUNK = 256  # prompt tokens prefilled between two decode steps (0: the whole prompt at once)
# Prompt tokens a loop turn at most while no stream decodes: no one's tokens wait on the chunk, and
# the NumPy engine's larger passes ran prompts faster (`CPUEngine._pass_rows`, docs/PERFORMANCE.md);
# mlx-lm's prefill step too. A prompt's chunks are evened out (`even_chunk`).
LONE_PREFILL_CHUNK = 2048
# Prompts fed in one pass (`Scheduler._together`) pad to the longest: at most this many rows for
# each real one. A padding row costs what a real one does, so a 10-token prompt padded to a
# 200-token one's length would cost more than the weights' second read that it saves.
PADDING = 1.5


class QueueFull(Exception):
    """The bounded queue has no free place; the caller answers 429."""


class ShuttingDown(Exception):
    """The server is draining; the caller answers 503."""


@dataclass
class _Sequence:
    """A job being decoded: its KV slot, sampler, reply state and the tokens it produced."""

    job: GenerationJob
    slot: Slot
    sampler: Sampler
    reply: ReplyDecoder
    cached_tokens: int = 0
    fed: int = 0  # prompt tokens in the cache so far (the rest is still to prefill)
    generated: list[int] = field(default_factory=list)
    drafter: Drafter | None = None  # None: speculation is off

    @property
    def cache(self):
        return self.slot.cache

    @property
    def last_token(self) -> int:
        return self.generated[-1]


class Scheduler:
    """Bounded queue + single worker thread + continuous batching over one engine."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer,
        slots: SlotPool,
        max_queue: int = 16,
        max_batch: int = 1,
        prefill_chunk: int = PREFILL_CHUNK,
        drafters: DrafterFactory | None = PromptLookup,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.slots = slots
        self.ctx = slots.ctx
        self.max_queue = max_queue
        self.max_batch = max(1, min(max_batch, len(slots.slots)))
        self.prefill_chunk = max(0, prefill_chunk)
        self.drafters = drafters  # makes each admitted sequence's drafter (None: no speculation)
        self.pass_costs = PassCosts()  # what each shape of engine pass costs: when a draft pays
        self.checkpoints = engine.config.is_hybrid  # place recurrent-state checkpoints (see the module doc)
        self._rollback_seconds = 0.0  # this step's truncations of rejected drafts (hybrid: recomputation)
        self.tokens_generated = 0  # every token the engine produced, for tests and metrics
        self._queue: deque[GenerationJob] = deque()
        self._prefilling: deque[_Sequence] = deque()  # admitted, prompt partly in the cache
        self._active: list[_Sequence] = []
        self._admitting = 0  # jobs taken from the queue, not yet prefilling
        self._calls: deque[tuple[Callable[[], object], Future]] = deque()  # engine work that is no generation
        self._cv = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="lmserve-worker", daemon=True)

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

    @property
    def stopping(self) -> bool:
        return self._stopping

    def abandon(self, message: str) -> None:
        """The engine cannot go on (a rank of a distributed group is gone): every queued and
        running job ends now, `message` its in-band error. Safe from any thread, even while the
        worker is stuck inside an engine call that will never return."""
        with self._cv:
            self._stopping = True
            jobs = [*self._queue, *(seq.job for seq in [*self._prefilling, *self._active])]
            self._queue.clear()
            self._cv.notify_all()
        for job in jobs:
            job.emit(Failed(message))

    def submit(self, job: GenerationJob) -> None:
        with self._cv:
            if self._stopping:
                raise ShuttingDown("the server is shutting down")
            if len(self._queue) >= self.max_queue:
                raise QueueFull(f"the request queue is full ({self.max_queue} waiting)")
            self._queue.append(job)
            self._cv.notify()

    def call(self, fn: Callable[[], object]) -> Future:
        """Run `fn` on the worker thread between two steps; its result (or exception) in the
        future. Counted against the queue's bound; ShuttingDown, QueueFull as `submit`."""
        future: Future = Future()
        with self._cv:
            if self._stopping:
                raise ShuttingDown("the server is shutting down")
            if len(self._queue) + len(self._calls) >= self.max_queue:
                raise QueueFull(f"the request queue is full ({self.max_queue} waiting)")
            self._calls.append((fn, future))
            self._cv.notify()
        return future

    def cancel(self, job: GenerationJob) -> None:
        """Drop a job whose client left: out of the queue now, out of the batch (slot given back)
        at the worker's next step. Safe from any thread; idempotent."""
        with self._cv:
            job.cancel()
            if job in self._queue:
                self._queue.remove(job)
            self._cv.notify()

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def active_sequences(self) -> int:
        """Sequences holding a batch row: being prefilled or decoded."""
        return len(self._active) + len(self._prefilling)

    @property
    def busy(self) -> bool:
        """Some job is queued, being admitted, prefilled or decoded (a model pool must not unload it)."""
        with self._cv:
            return bool(self._queue or self._calls or self._admitting or self._prefilling or self._active)

    # -- worker side -------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cv:
                while (not self._stopping and not self._queue and not self._calls and not self._prefilling
                       and not self._active):
                    self._cv.wait()
                if self._stopping:
                    break
                calls = list(self._calls)
                self._calls.clear()
                admit = []
                while self._queue and self.active_sequences + len(admit) < self.max_batch:
                    admit.append(self._queue.popleft())
                self._admitting = len(admit)
            for fn, future in calls:
                if future.set_running_or_notify_cancel():  # False: cancelled while it waited
                    try:
                        future.set_result(fn())
                    except Exception as exc:  # noqa: BLE001  (the caller gets it; the worker goes on)
                        future.set_exception(exc)
            for job in admit:
                self._admit(job)
            with self._cv:
                self._admitting = 0
            self._drop_cancelled()
            if self._prefilling:
                self._prefill_chunk()
            if self._active:
                self._step()
        self._shutdown()

    def _shutdown(self) -> None:
        with self._cv:
            pending = list(self._queue)
            self._queue.clear()
            calls = list(self._calls)
            self._calls.clear()
        for _, future in calls:
            if future.set_running_or_notify_cancel():
                future.set_exception(ShuttingDown("the server is shutting down"))
        for seq in [*self._prefilling, *self._active]:
            self._retire(seq)
            pending.append(seq.job)
        self._prefilling.clear()
        self._active = []
        for job in pending:
            job.emit(Failed("the server is shutting down", 503, "overloaded_error"))
        self.slots.spill_all()

    def _admit(self, job: GenerationJob) -> None:
        """Take a KV slot (adopting what it already holds of the prompt) and queue the rest of
        the prompt for prefill; the job's first event says how much was cached."""
        if job.cancelled.is_set():
            return
        try:
            adoption = self.slots.acquire(job.prompt_ids, job.session_id)
            if adoption is None:  # cannot happen while slots >= batch; fail loudly if it does
                raise RuntimeError("no free KV slot")
        except Exception as exc:  # one request's failure never takes the worker down
            log.exception("KV slot adoption failed")
            job.emit(Failed(f"generation failed: {exc}"))
            return
        seq = _Sequence(job, adoption.slot, Sampler(job.sampling, job.prompt_ids),
                        ReplyDecoder(job.reply, self.tokenizer.token_bytes, job.stop, job.max_tokens),
                        adoption.reused, fed=adoption.reused,
                        drafter=self.drafters(job.prompt_ids) if self.drafters else None)
        if self.checkpoints and adoption.reused:  # a previous turn's end may be resumed from again
            self.engine.checkpoint(seq.cache)
        job.emit(Started(len(job.prompt_ids), adoption.reused))
        self._prefilling.append(seq)

    def _drop_cancelled(self) -> None:
        """Sequences whose client left give back their batch row and slot."""
        for seq in [*self._prefilling, *self._active]:
            if seq.job.cancelled.is_set():
                self._retire(seq)
        self._prefilling = deque(s for s in self._prefilling if not s.job.cancelled.is_set())
        self._active = [s for s in self._active if not s.job.cancelled.is_set()]

    def _prefill_chunk(self) -> None:
        """Feed the next chunk of the oldest admitted prompt; the last chunk's logits give the
        first token, and the sequence joins the decoding batch. One whose client left during the
        chunk (a lone prompt's chunk may be its whole prompt) gets no token: the next loop turn
        drops it. Prompts that arrived together and fit one chunk are fed in one pass
        (`_together`)."""
        together = self._together()
        if len(together) > 1:
            self._prefill_together(together)
            return
        seq = self._prefilling[0]
        prompt = seq.job.prompt_ids
        end = len(prompt) if not self.prefill_chunk else seq.fed + even_chunk(len(prompt) - seq.fed, self._chunk_size())
        if self.checkpoints:
            end = self._checkpointed_end(seq, end)
        try:
            logits = self.engine.prefill(seq.cache, prompt[seq.fed:end])
            seq.fed = end
            if self.checkpoints:
                self.engine.checkpoint(seq.cache)
            if end < len(prompt) or seq.job.cancelled.is_set():
                return
            self._prefilling.popleft()
            if not self._advance(seq, logits=logits):
                self._active.append(seq)
        except Exception as exc:  # one request's failure never takes the worker down
            log.exception("prefill failed")
            if self._prefilling and self._prefilling[0] is seq:
                self._prefilling.popleft()
            self._fail(seq, exc)

    def _together(self) -> list[_Sequence]:
        """The oldest admitted prompt and others after it that one pass can finish: their rests'
        rows padded to the longest (`Engine.prefill_together`) within a chunk and at most PADDING
        times their own, each within its cache's room. None for a hybrid model, whose prompts end
        at checkpoints."""
        if self.checkpoints or len(self._prefilling) < 2:
            return []
        most, chosen, width, rows = self._chunk_size(), [], 0, 0
        for seq in self._prefilling:
            left = len(seq.job.prompt_ids) - seq.fed
            wider = max(width, left)
            if (wider * (len(chosen) + 1) > most or wider * (len(chosen) + 1) > PADDING * (rows + left)
                    or any(s.fed + wider > s.cache.capacity for s in [*chosen, seq])):
                if not chosen:  # the oldest goes first, by itself
                    return []
                continue
            chosen.append(seq)
            width, rows = wider, rows + left
        return chosen

    def _prefill_together(self, together: list[_Sequence]) -> None:
        """Feed these prompts' rests in one pass; each gets its first token and joins the batch
        (one whose client left meanwhile gets none: the next loop turn drops it)."""
        try:
            rows = self.engine.prefill_together([s.cache for s in together],
                                                [s.job.prompt_ids[s.fed:] for s in together])
        except Exception as exc:  # one pass's failure fails its prompts, never the worker
            log.exception("prefill failed")
            self._stop_prefilling(together)
            for seq in together:
                self._fail(seq, exc)
            return
        for seq in together:
            seq.fed = len(seq.job.prompt_ids)
        # One whose client left meanwhile stays, for the next loop turn to drop (`_drop_cancelled`);
        # the flag is read once, so a client leaving now cannot leave its sequence in neither list.
        staying = [(s, logits) for s, logits in zip(together, rows, strict=True) if not s.job.cancelled.is_set()]
        self._stop_prefilling([s for s, _ in staying])
        for seq, logits in staying:
            try:
                done = self._advance(seq, logits=logits)
            except Exception as exc:  # one sequence's failure leaves the others going
                log.exception("sequence failed")
                self._fail(seq, exc)
                continue
            if not done:
                self._active.append(seq)

    def _stop_prefilling(self, done: list[_Sequence]) -> None:
        """Take these sequences out of the prefill queue (by identity)."""
        gone = {id(seq) for seq in done}
        self._prefilling = deque(seq for seq in self._prefilling if id(seq) not in gone)

    def _chunk_size(self) -> int:
        """The most tokens of the next chunk: `prefill_chunk` while streams decode (it bounds how
        long their next token waits); while none does, LONE_PREFILL_CHUNK (or `prefill_chunk`
        where that is larger)."""
        return self.prefill_chunk if self._active else max(self.prefill_chunk, LONE_PREFILL_CHUNK)

    def _checkpointed_end(self, seq: _Sequence, end: int) -> int:
        """A hybrid prompt's chunk ends where a checkpoint is wanted: at the end of the history
        (before the generation prompt, where the next turn's prompt parts from this one), and before
        the last token, which is prefilled alone."""
        last = len(seq.job.prompt_ids)
        if seq.fed < seq.job.history_end < end:
            return seq.job.history_end
        return end - 1 if end == last and end - seq.fed > 1 else end

    def _step(self) -> None:
        """One engine pass for every running sequence: a verify pass when any has a draft (the
        others take part with their one token), else a decode step."""
        caches = [s.cache for s in self._active]
        positions = max(c.length for c in caches)  # before the pass: what `_drafts` judged it by
        tokens = [s.last_token for s in self._active]
        drafts = self._drafts()
        verify = any(drafts)
        device_greedy = not verify and self.engine.device_argmax and not any(
            s.job.sampling.needs_host_logits or s.reply.needs_logits for s in self._active)
        width = 1 + max(map(len, drafts))
        start = time.perf_counter()
        try:
            if verify:
                rows = self.engine.verify(caches, [[t, *d] for t, d in zip(tokens, drafts, strict=True)])
            else:
                rows = self.engine.decode_argmax(caches, tokens) if device_greedy else self.engine.decode(caches, tokens)
            seconds = time.perf_counter() - start
        except Exception as exc:  # the engine step failed: every sequence in it fails
            log.exception("decode step failed")
            for seq in self._active:
                self._fail(seq, exc)
            self._active = []
            return
        still = []
        for seq, draft, row in zip(self._active, drafts, rows, strict=True):
            try:
                if verify:
                    done = self._verified(seq, draft, row)
                else:
                    done = self._advance(seq, token=int(row)) if device_greedy else self._advance(seq, logits=row)
            except Exception as exc:  # one sequence's failure leaves the others decoding
                log.exception("sequence failed")
                self._fail(seq, exc)
                done = True
            if not done:
                still.append(seq)
        self._active = still
        # A verify pass costs its rollbacks too (a hybrid cache recomputes the positions it keeps).
        self.pass_costs.record(len(caches), width, seconds + self._rollback_seconds, positions)
        self._rollback_seconds = 0.0

    def _drafts(self) -> list[list[int]]:
        """Each running sequence's draft ([]: none), capped so that taking all of it cannot pass
        the request's max_tokens, and so that every cache has room for the longest list (a verify
        pass may pad the others to it); none at all when they are not worth a verify pass."""
        if not any(s.drafter for s in self._active):
            return [[] for _ in self._active]
        room = min(s.cache.capacity - s.cache.length for s in self._active) - 1
        shared = len(self._active) > 1
        drafts: list[list[int]] = []
        for seq in self._active:
            limit = min(room, seq.job.max_tokens - len(seq.generated) - 1)
            try:
                drafts.append(seq.drafter.draft(limit, shared) if seq.drafter else [])
            except Exception:  # a drafter's failure (a draft model's) costs its sequence the drafts only
                log.exception("drafting failed: the sequence goes on without drafts")
                seq.drafter = None
                drafts.append([])
        positions = max(s.cache.length for s in self._active)
        pays = self.pass_costs.pays([s.drafter for s in self._active], drafts, positions) if any(drafts) else True
        if pays:
            return drafts
        if pays is False:  # measured not worth the pass: those drafting pause (None: a step is timed first)
            for seq, draft in zip(self._active, drafts, strict=True):
                if draft and seq.drafter is not None:
                    seq.drafter.hold()
        return [[] for _ in self._active]

    def _verified(self, seq: _Sequence, draft: list[int], logits: np.ndarray) -> bool:
        """Pick from each verified position as plain decoding would and keep the draft while the
        picks agree with it. With sampling, drawing from p and accepting the draft token x when
        the draw is x is the standard speculative rule for a one-hot draft (accepted with
        probability p(x); a rejection is distributed as p without x, renormalised), and it uses
        the request's random stream as plain decoding does: a seeded reply does not depend on
        speculation. True when the job is over."""
        base = seq.cache.length - len(logits)  # before the pass, which fed the last token and the draft
        reason, accepted = None, 0
        for i, row in enumerate(logits):
            token, adjusted = seq.sampler.sample(seq.reply.mask(row))
            hit = i < len(draft) and token == draft[i]
            accepted += hit
            reason = self._emit(seq, token, adjusted)
            if reason or not hit:
                break
        # The cache keeps the fed token and the accepted drafts, never more than the reply holds
        # (an accepted end-of-turn token is not part of it).
        keep = min(base + 1 + accepted, seq.fed + len(seq.generated))
        if keep < seq.cache.length:
            start = time.perf_counter()
            self.engine.truncate(seq.cache, keep)
            self._rollback_seconds += time.perf_counter() - start
        if draft and seq.drafter is not None:
            seq.drafter.record(len(draft), accepted)
        return reason is not None and self._finish(seq, reason)

    def _fail(self, seq: _Sequence, exc: Exception) -> None:
        self.slots.release(seq.slot, [])
        seq.job.emit(Failed(f"generation failed: {exc}"))

    def _advance(self, seq: _Sequence, logits: np.ndarray | None = None, token: int | None = None) -> bool:
        """Sample (unless the device already did), stream the token; True when the job is over."""
        if token is None:
            token, adjusted = seq.sampler.sample(seq.reply.mask(logits))
        else:
            seq.sampler.accept(token)
            adjusted = None
        reason = self._emit(seq, token, adjusted)
        return reason is not None and self._finish(seq, reason)

    def _emit(self, seq: _Sequence, token: int, adjusted: np.ndarray | None) -> str | None:
        """Stream one picked token; the finish reason when the job is over with it, else None."""
        job = seq.job
        self.tokens_generated += 1
        seq.generated.append(token)
        if seq.drafter is not None:
            seq.drafter.extend([token])
        if token in self.tokenizer.eog_ids:  # the end-of-turn token is not part of the reply
            seq.generated.pop()
            return "stop"
        lp = None
        if job.sampling.logprobs and adjusted is not None:
            lp = token_logprob(adjusted, token, job.sampling.top_logprobs,
                               self.tokenizer.piece, self.tokenizer.token_bytes)
        for event in seq.reply.push(token, lp):
            job.emit(event)
        if seq.reply.done:
            return "stop"
        # The positions a next step would need (the cache may hold unverified drafts right now).
        if len(seq.generated) >= job.max_tokens or seq.fed + len(seq.generated) > self.ctx:
            return "length"
        return None

    def _finish(self, seq: _Sequence, reason: str) -> bool:
        for event in seq.reply.finish():
            seq.job.emit(event)
        self._retire(seq)
        if reason == "stop" and seq.reply.tool_calls:
            reason = "tool_calls"
        drafter = seq.drafter
        usage = SpeculationUsage(len(seq.job.prompt_ids), len(seq.generated), seq.cached_tokens,
                                 seq.reply.reasoning_tokens, drafter.drafted if drafter else 0,
                                 drafter.accepted if drafter else 0)
        seq.job.emit(Finished(reason, usage, seq.reply.stop_sequence))
        return True

    def _retire(self, seq: _Sequence) -> None:
        """Give the slot back holding what was fed through it, for the next turn to reuse."""
        self.slots.release(seq.slot, seq.job.prompt_ids[:seq.fed] + seq.generated)
