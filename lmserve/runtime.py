"""The serving runtime: one loaded model, its engine and the scheduler, and request admission.

Dialect adapters hand a normalized ChatRequest (or prompt ids) to `Runtime.start_chat` /
`start_job`; it builds the prompt, checks it against the context, sizes the reply budget, queues
the job and returns its RequestHandle, the only thing HTTP holds of it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from lmserve.chat import reasoning
from lmserve.chat.planner import ReplyPlanner
from lmserve.chat.prompt import PromptBuilder
from lmserve.chat.reply import ReplyPlan
from lmserve.core.errors import RequestError
from lmserve.core.types import ChatRequest, OutputFormat, SamplingParams
from lmserve.engine.protocol import Engine
from lmserve.model.families import EMBEDDED_DEMO, recommended_sampling
from lmserve.model.loader import LoadedModel
from lmserve.serving.embeddings import check_pooling, embed_tokens
from lmserve.serving.handle import Observer, RequestHandle
from lmserve.serving.jobs import EventChannel, GenerationJob
from lmserve.serving.kv_disk import DiskTier
from lmserve.serving.kv_slots import SlotPool
from lmserve.serving.ram_guard import fit_report, plan_slots, slot_state_bytes
from lmserve.serving.scheduler import QueueFull, Scheduler, ShuttingDown
from lmserve.serving.speculate import DEFAULT_MODE, drafters
from lmserve.settings import Settings

COMPLETIONS_MAX_TOKENS = 16  # the legacy completions API's default reply budget


@dataclass(frozen=True)
class RuntimeStatus:
    engine: str
    device: str
    max_batch: int  # sequences decoded together (--batch, at most the slots)
    queue_depth: int  # requests waiting for the worker
    active_sequences: int  # sequences being generated
    tokens_generated: int
    kv: dict[str, Any]  # the slot pool's figures (slots, kv_bytes, ...), the KV type and its bytes a position
    warm: bool  # first-use work (tool parsers, grammar tokenizer) done


@dataclass
class PreparedChat:
    """A chat rendered, tokenized and planned, ready to queue."""

    request: ChatRequest
    ids: list[int]
    plan: ReplyPlan
    history_end: int


class Runtime:
    """Owns model, engine and scheduler for the lifetime of the server."""

    def __init__(self, model: LoadedModel, engine: Engine, settings: Settings,
                 draft_engine: Engine | None = None) -> None:
        """`settings` with its context resolved (`Settings.with_resolved`); raises MemoryRefusal
        when not even one KV slot of that context fits."""
        if settings.ctx is None:
            raise ValueError("Runtime needs the context resolved (Settings.with_resolved(ctx=...))")
        self.model = model
        self.engine = engine
        self.settings = settings
        self.ctx: int = settings.ctx
        self.started_at = time.time()
        self.prompts = PromptBuilder(model.tokenizer, model.template)
        self.sampling_defaults = EMBEDDED_DEMO if model.embedded else recommended_sampling(
            model.config.architecture, model.gguf.metadata)
        if settings.temp is not None:
            self.sampling_defaults = self.sampling_defaults.with_temperature(settings.temp)
        self.replies = ReplyPlanner(model.tokenizer, model.template)
        cfg = model.config
        engine.checkpoints_per_cache = settings.kv_checkpoints
        self.slot_budget = plan_slots(settings.kv_slots, engine.kv_bytes_per_token(), self.ctx,
                                      engine.available_memory, force=settings.kv_slots_force,
                                      state_bytes=slot_state_bytes(engine))
        disk = None
        if settings.kv_cache_dir is not None:
            disk = DiskTier(settings.kv_cache_dir, model.gguf.header_digest(),
                            [engine.name, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim], settings.kv_disk_slots)
        self.warm = threading.Event()  # set once first-use work (tool parsers, grammar tokenizer) is done
        self.slots = SlotPool(engine, self.slot_budget.slots, self.ctx, disk, settings.kv_reuse)
        self.scheduler = Scheduler(engine, model.tokenizer, self.slots, settings.queue, settings.batch,
                                   settings.prefill_chunk,
                                   drafters(settings.speculate or DEFAULT_MODE, self.ctx, model.config.vocab_size,
                                            draft_engine))

    def start(self) -> None:
        self.engine.on_lost(self.scheduler.abandon)  # a lost rank ends the open requests in-band
        self.scheduler.start()
        replies, warm = self.replies, self.warm  # not self: an unloaded model must not wait for its warm-up

        def warm_up() -> None:
            replies.warm_up()
            warm.set()

        threading.Thread(target=warm_up, name="lmserve-warm-up", daemon=True).start()

    def stop(self) -> None:
        """Stop the worker, then let the engine go (a distributed one: its followers exit)."""
        self.scheduler.stop()
        self.engine.close()

    def request_stop(self) -> None:
        """The server was told to stop: the worker ends open streams as the engine allows."""
        self.engine.stopping(self.scheduler.request_stop)

    def model_info(self) -> dict[str, Any]:
        """What /health and /v1/models say about the served model."""
        cfg = self.model.config
        return {"family": cfg.family, "architecture": cfg.architecture, "parameters": cfg.n_params,
                "active_parameters": cfg.n_active_params, "experts": cfg.n_experts,
                "experts_per_token": cfg.n_experts_used, "context": self.ctx,
                "trained_context": cfg.context_length, "quant_mix": cfg.quant_mix}

    def status(self) -> RuntimeStatus:
        """The live figures /health, /metrics and the CLI report, read here rather than from the
        scheduler and slot pool themselves."""
        scheduler = self.scheduler
        kv = {**self.slots.stats(), "type": self.engine.kv_type, "bytes_per_token": self.engine.kv_bytes_per_token()}
        return RuntimeStatus(self.engine.name, self.engine.device, scheduler.max_batch, scheduler.queue_depth,
                             scheduler.active_sequences, scheduler.tokens_generated, kv, self.warm.is_set())

    def fit(self, ctx: int | None = None, slots: int | None = None) -> dict[str, int | bool]:
        """The RAM guard's arithmetic for this model at `ctx` tokens and `slots` slots (default:
        as served), against the memory available now (GET /fit)."""
        return fit_report(self.engine.weight_bytes, self.engine.kv_bytes_per_token(), slot_state_bytes(self.engine),
                          ctx or self.ctx, slots or self.slot_budget.slots, self.engine.available_memory)

    @property
    def busy(self) -> bool:
        """A request is queued, admitted, prefilling or decoding: the model must stay loaded."""
        return self.scheduler.busy

    def footprint(self) -> int:
        """Bytes of the weights and of every KV slot at full context: the most this model holds."""
        return self.engine.weight_bytes + self.slot_budget.slots * self.slot_budget.per_slot

    @property
    def draining(self) -> bool:
        """Shutdown has begun: new requests are refused with 503."""
        return self.scheduler.stopping

    def count_prompt_tokens(self, request: ChatRequest) -> int:
        return self.prompts.count(reasoning.settle(request, self.settings.reasoning_budget))

    def prepare_chat(self, request: ChatRequest) -> PreparedChat:
        """The CPU-heavy part of starting a chat (the template, grammars, tokenizing), safe on any
        thread: the HTTP layer runs it off the event loop, so a huge body stalls no one else."""
        request = reasoning.settle(request, self.settings.reasoning_budget)
        prompt = self.prompts.render(request)
        plan = self.replies.plan(request, prompt)  # compiles grammars: a bad one is a 400 here
        ids = self.prompts.encode(prompt)
        history_end = self.prompts.history_end(request, ids) if self.engine.config.is_hybrid else 0
        return PreparedChat(request, ids, plan, history_end)

    def start_prepared(self, chat: PreparedChat, observer: Observer | None = None) -> RequestHandle:
        """Queue a prepared chat (on the event loop: its events are delivered there)."""
        request = chat.request
        return self.start_job(chat.ids, request.sampling, request.max_tokens, request.stop, request.session_id,
                              chat.plan, observer, chat.history_end)

    def start_chat(self, request: ChatRequest, observer: Observer | None = None) -> RequestHandle:
        return self.start_prepared(self.prepare_chat(request), observer)

    def plan_completion(self, output_format: OutputFormat | None) -> ReplyPlan:
        """Raw prompts' reply plan, its grammar compiled (CPU-heavy: any thread)."""
        return self.replies.plan_completion(output_format)

    def start_completion(self, prompts: list[list[int]], sampling: SamplingParams, max_tokens: int | None,
                         stop: list[str], plan: ReplyPlan, session_id: str | None = None,
                         observer: Observer | None = None) -> list[RequestHandle]:
        """Raw prompts (no template), one job each, sharing one grammar plan (`plan_completion`);
        all or none are queued."""
        handles: list[RequestHandle] = []
        try:
            for prompt in prompts:
                handles.append(self.start_job(prompt, sampling, max_tokens, stop, session_id, plan, observer,
                                              api_default=COMPLETIONS_MAX_TOKENS))
        except RequestError:
            for handle in handles:
                handle.cancel()
            raise
        return handles

    def embed(self, inputs: list[list[int]], param: str = "input") -> asyncio.Future[list[np.ndarray]]:
        """Each input's embedding (pooled, normalized: serving/embeddings.py), computed by the
        worker between two steps; RequestError for an empty input, one past the context, or a
        model whose pooling gives none. Cancelling the future drops it if it has not run yet."""
        try:
            check_pooling(self.model.config.pooling)
        except ValueError as exc:
            raise RequestError(f"this model gives no embeddings: {exc}", 400, param, "model_not_embedding") from None
        for i, ids in enumerate(inputs):
            where = param if len(inputs) == 1 else f"{param}[{i}]"
            if not ids:
                raise RequestError(f"{where}: an input is empty", 400, where)
            if len(ids) > self.ctx:
                raise RequestError(f"{where} has {len(ids)} tokens but the context size is {self.ctx} tokens",
                                   400, where, "context_length_exceeded")
        engine, config = self.engine, self.model.config
        try:
            future = self.scheduler.call(lambda: [embed_tokens(engine, ids, config) for ids in inputs])
        except ShuttingDown:
            raise shutting_down() from None
        except QueueFull as exc:
            raise RequestError(f"server busy: {exc}; retry shortly", 429, None, "queue_full",
                               {"Retry-After": "1"}) from None
        return asyncio.wrap_future(future)

    def resolved_sampling(self, sampling: SamplingParams) -> SamplingParams:
        """The sampling a request gets: its own fields, then the server's --temp and the model's
        recommended values (what a dialect that echoes its sampling must report)."""
        return sampling.with_defaults(self.sampling_defaults.values())

    def reply_budget(self, max_tokens: int | None, prompt_tokens: int, api_default: int | None = None) -> int:
        """The request's budget, else the server's --max-tokens, else the API's own default (the
        legacy completions API's 16), else the rest of the context; never past the context."""
        rest = self.ctx - prompt_tokens
        asked = next((v for v in (max_tokens, self.settings.max_tokens, api_default) if v is not None), rest)
        return min(asked, rest)

    def start_job(self, prompt_ids: list[int], sampling: SamplingParams, max_tokens: int | None,
                  stop: list[str], session_id: str | None = None, plan: ReplyPlan | None = None,
                  observer: Observer | None = None, history_end: int = 0,
                  api_default: int | None = None) -> RequestHandle:
        """Validate the prompt against the context and queue it; raises RequestError."""
        n = len(prompt_ids)
        if n == 0:
            raise RequestError("the prompt is empty", 400, "messages")
        if n >= self.ctx:
            raise RequestError(
                f"the prompt has {n} tokens but the context size is {self.ctx} tokens; "
                "shorten the conversation or start the server with a larger --ctx",
                400, "messages", "context_length_exceeded")
        max_tokens = self.reply_budget(max_tokens, n, api_default)
        sampling = self.resolved_sampling(sampling)
        job = GenerationJob(prompt_ids, sampling, max_tokens, EventChannel(asyncio.get_running_loop()),
                            stop, session_id, reply=plan or ReplyPlan(), history_end=history_end)
        try:
            self.scheduler.submit(job)
        except ShuttingDown:
            raise shutting_down() from None
        except QueueFull as exc:
            raise RequestError(f"server busy: {exc}; retry shortly", 429, None, "queue_full",
                               {"Retry-After": "1"}) from None
        return RequestHandle(job, self.scheduler.cancel, observer)


def shutting_down() -> RequestError:
    """A request that arrives while the server drains: 503, and the connection is not reused."""
    return RequestError("the server is shutting down; retry against another instance or after it restarts",
                        503, None, "server_shutting_down", {"Connection": "close", "Retry-After": "5"})
