"""One sequence's reply: the constraint on its next token, and its tokens turned into events.

Before sampling, the active constraint (if any) masks the logits: the request's grammar for the
whole reply, the call grammar once the router sees a tool call open under tool_choice auto, or the
closing think tag (harmony: the end of the analysis message) once thinking has used its budget.
After sampling, the token goes through TokenStream (UTF-8), the router (ReplyRouter, or
HarmonyRouter for gpt-oss's channels: reasoning, tool calls, answer text) and a StopFilter on the
answer text: stop strings end the reply only where they appear in the answer, never inside the
think block or a tool call's body. Once a stop string appears every later event is dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from lmserve.chat.grammar import CompiledGrammar, Constraint, ForcedTokens
from lmserve.chat.harmony import HarmonyRouter
from lmserve.chat.reply_router import THINK, CallRouting, ReplyRouter, Router, ThinkMarkers
from lmserve.chat.token_stream import StopFilter, TokenStream
from lmserve.core.events import Event, TextDelta, TokenLogprob, ToolCallEvent

THINK_SHARE = 0.75  # thinking may use at most this share of max_tokens


@dataclass
class ReplyPlan:
    """What the worker needs, beyond sampling, to decode one reply; built at admission."""

    think: bool = False  # route a leading think block to reasoning
    think_markers: ThinkMarkers = THINK  # how the family writes that block
    in_think: bool = False  # the prompt itself opened the think block
    thinking_budget: int | None = None
    close_think: list[int] = field(default_factory=list)  # forced when the budget is spent
    calls: CallRouting | None = None
    grammar: CompiledGrammar | None = None  # governs the whole reply; its end ends the turn
    call_grammar: CompiledGrammar | None = None  # takes over once a call opens (tool_choice auto)
    harmony: str | None = None  # gpt-oss channels: the state the reply starts in ("header", "analysis", "final")


class ReplyDecoder:
    """Per-sequence reply state, driven by the scheduler one token at a time."""

    def __init__(self, plan: ReplyPlan, token_bytes: Callable[[int], bytes], stop: list[str],
                 max_tokens: int) -> None:
        self.plan = plan
        self.stream = TokenStream(token_bytes)  # UTF-8 only: stop strings apply to the answer
        self.router: Router = (HarmonyRouter(plan.calls, plan.harmony) if plan.harmony
                               else ReplyRouter(plan.think, plan.calls, plan.in_think, plan.think_markers))
        self.stops = StopFilter(stop)
        self.constraint: Constraint | None = plan.grammar.constraint() if plan.grammar else None
        self._governing = self.constraint
        budget = int(max_tokens * THINK_SHARE)
        self._think_budget = min(plan.thinking_budget, budget) if plan.thinking_budget else budget
        self._think_closed = False
        self._calls_seen = 0  # calls the router has opened that the call grammar was offered
        self.reasoning_tokens = 0
        self.tool_calls = 0
        self.complete = False  # the governing grammar is complete

    @property
    def needs_logits(self) -> bool:
        """The next token must be picked from masked host logits (no device argmax)."""
        return self.constraint is not None

    @property
    def done(self) -> bool:
        return self.complete or self.stops.stopped

    @property
    def stop_sequence(self) -> str | None:
        return self.stops.stop_sequence

    def mask(self, logits: np.ndarray) -> np.ndarray:
        return self.constraint.mask(logits) if self.constraint is not None else logits

    def push(self, token: int, logprob: TokenLogprob | None = None) -> list[Event]:
        """One sampled token (not end-of-turn); returns the events it completes."""
        if self.constraint is not None:
            self.constraint.consume(token)
        if self.router.thinking:
            self.reasoning_tokens += 1
        delta = self.stream.push(token, logprob)
        events = self._answer(self.router.feed(delta)) if delta is not None else []
        self._next_constraint()
        return events

    def finish(self) -> list[Event]:
        """The end of the reply: release everything held back."""
        tail = self.stream.flush()
        events = self.router.feed(tail) if tail is not None else []
        return self._answer(events + self.router.flush(), final=True)

    def _answer(self, events: list[Event], final: bool = False) -> list[Event]:
        """Stop strings over the routed events' answer text. Answer text held back (it may still
        become a stop string) is released before any other event, keeping the order: a call or
        reasoning between two pieces of text means they cannot form one stop string."""
        out: list[Event] = []
        for event in events:
            text = isinstance(event, TextDelta)
            released = self.stops.feed(event) if text else self.stops.flush()
            if released is not None:
                out.append(released)
            if self.stops.stopped:
                break  # what follows a stop string is never sent
            if not text:
                out.append(event)
        if final and (tail := self.stops.flush()) is not None:
            out.append(tail)
        self.tool_calls += sum(isinstance(e, ToolCallEvent) for e in out)
        return out

    def _next_constraint(self) -> None:
        if self.constraint is not None:
            if not self.constraint.finished:
                return
            self.complete = self.constraint is self._governing
            self.constraint = None
            return
        if self.router.thinking:
            if not self._think_closed and self.reasoning_tokens >= self._think_budget and self.plan.close_think:
                self._think_closed = True
                self.constraint = ForcedTokens(self.plan.close_think)
        elif self.plan.call_grammar is not None and self.router.opened > self._calls_seen:
            self._watch_for_call(self.plan.call_grammar)

    def _watch_for_call(self, grammar: CompiledGrammar) -> None:
        """Hand the rest of a call to the call grammar as soon as the router sees it open: the
        grammar is primed with what was written from the opener on (the router's text, plus the
        bytes of a character not complete yet)."""
        self._calls_seen = self.router.opened
        written = self.router.open_call
        if written is not None:  # None: the call opened and closed within this token
            self.constraint = grammar.constraint(written.encode() + self.stream.pending)  # None: malformed
