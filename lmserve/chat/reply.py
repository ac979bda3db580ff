"""One sequence's reply: the constraint on its next token, and its tokens turned into events.

Before sampling, the active constraint (if any) masks the logits: the request's grammar for the
whole reply (after the think block, when the prompt opened one), the call grammar once the router
sees a tool call open under tool_choice auto, or the closing think tag (harmony: the end of the
analysis message) once thinking has used its budget; a governing grammar consumes the forced
closing tokens too, so it continues where the reasoning was cut off.
After sampling, the token goes through TokenStream (UTF-8), the router (ReplyRouter, or
HarmonyRouter for gpt-oss's channels: reasoning, tool calls, answer text) and a StopFilter on the
answer text: stop strings end the reply only where they appear in the answer, never inside the
think block or a tool call's body. Once a stop string appears every later event is dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from lmserve.chat.grammar import CompiledGrammar, Constraint, Excluding, ForcedTokens
from lmserve.chat.harmony import HarmonyRouter
from lmserve.chat.reasoning import think_budget
from lmserve.chat.reply_router import THINK, CallRouting, ReplyRouter, Router, ThinkMarkers
from lmserve.chat.token_stream import StopFilter, TokenStream
from lmserve.core.events import Event, ReasoningDelta, TextDelta, TokenLogprob, ToolCallEvent


@dataclass
class ReplyPlan:
    """What the worker needs, beyond sampling, to decode one reply; built at admission."""

    think: bool = False  # route a leading think block to reasoning
    think_markers: ThinkMarkers = THINK  # how the family writes that block
    in_think: bool = False  # the prompt itself opened the think block (a grammar starts after it)
    end_ids: frozenset[int] = frozenset()  # end-of-turn tokens, refused while a grammar waits for the think block
    thinking_budget: int | None = None  # tokens (None: only the share of max_tokens bounds it)
    close_think: list[int] = field(default_factory=list)  # forced when the budget is spent
    calls: CallRouting | None = None
    single_call: bool = False  # parallel_tool_calls false: the reply ends with its first call
    grammar: CompiledGrammar | None = None  # governs the whole reply; its end ends the turn
    # reasoning_format none: reasoning is given back as answer text between these markers
    inline_reasoning: tuple[str, str] | None = None
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
        self._governing = plan.grammar.constraint() if plan.grammar else None
        self._governing_on = not plan.in_think  # else it starts where the prompt's think block ends
        # while it waits, the reply may not end: the grammar's text must still come
        self._waiting = Excluding(plan.end_ids) if self._governing is not None and not self._governing_on else None
        self.constraint: Constraint | None = self._resting()
        self._think_budget = think_budget(plan.thinking_budget, max_tokens, governed=plan.grammar is not None)
        self._calls_seen = 0  # calls the router has opened that the call grammar was offered
        self.reasoning_tokens = 0
        self.tool_calls = 0
        self._inlining = False  # inline reasoning: its opening marker was given, its closing not yet
        self.complete = False  # the governing grammar is complete

    @property
    def needs_logits(self) -> bool:
        """The next token must be picked from masked host logits (no device argmax)."""
        return self.constraint is not None

    @property
    def done(self) -> bool:
        return self.complete or self.stops.stopped or (self.plan.single_call and self.tool_calls > 0)

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
        events = self._answer(self._inline(self.router.feed(delta))) if delta is not None else []
        self._next_constraint()
        return events

    def finish(self) -> list[Event]:
        """The end of the reply: release everything held back."""
        tail = self.stream.flush()
        events = self._inline(self.router.feed(tail) if tail is not None else [])
        events += self._inline(self.router.flush())
        if self._inlining and not self.router.thinking:  # the block closed, and the reply with it
            events.append(TextDelta(self.plan.inline_reasoning[1]))  # type: ignore[index]
        return self._answer(events, final=True)

    def _inline(self, events: list[Event]) -> list[Event]:
        """Under reasoning_format none, reasoning becomes answer text within its markers."""
        if self.plan.inline_reasoning is None:
            return events
        opener, closer = self.plan.inline_reasoning
        out: list[Event] = []
        for event in events:
            if isinstance(event, ReasoningDelta):
                if not self._inlining:
                    out.append(TextDelta(opener))
                self._inlining = True
                out.append(TextDelta(event.text))
                continue
            if self._inlining:
                out.append(TextDelta(closer))
                self._inlining = False
            out.append(event)
        return out

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
            if not text and not (self.plan.single_call and self.tool_calls and isinstance(event, ToolCallEvent)):
                out.append(event)
                self.tool_calls += isinstance(event, ToolCallEvent)
        if final and (tail := self.stops.flush()) is not None:
            out.append(tail)
        return out

    def _next_constraint(self) -> None:
        active = self.constraint
        if active is not None and active.finished:
            if active is self._governing:
                self.complete = True
                self.constraint = None
                return
            self.constraint = self._resting()  # a forced close or a guarded call ended
        elif active is not None and active not in (self._governing, self._waiting):
            return  # a forced close or a guarded call runs to its end
        if self.router.thinking:
            # Not inside a character: a grammar governing the reply refuses a close that cuts one.
            if self.reasoning_tokens >= self._think_budget and self.plan.close_think and not self.stream.pending:
                self.constraint = ForcedTokens(self.plan.close_think, under=self.constraint)
        elif self._governing is not None and not self._governing_on:  # the prompt's think block ended
            self._governing_on = True
            self.constraint = self._governing
        elif self.constraint is None and self.plan.call_grammar is not None and self.router.opened > self._calls_seen:
            self._watch_for_call(self.plan.call_grammar)

    def _resting(self) -> Constraint | None:
        """The constraint between forced closes and guarded calls: the governing grammar, or
        while it waits for the think block to close, the ban on ending the reply."""
        return self._governing if self._governing_on else self._waiting

    def _watch_for_call(self, grammar: CompiledGrammar) -> None:
        """Hand the rest of a call to the call grammar as soon as the router sees it open: the
        grammar is primed with what was written from the opener on (the router's text, plus the
        bytes of a character not complete yet)."""
        self._calls_seen = self.router.opened
        written = self.router.open_call
        if written is not None:  # None: the call opened and closed within this token
            self.constraint = grammar.constraint(written.encode() + self.stream.pending)  # None: malformed
