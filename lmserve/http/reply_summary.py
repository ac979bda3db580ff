"""A finished job's events gathered into the parts every non-streaming body is built from."""

from __future__ import annotations

from dataclasses import dataclass

from lmserve.core.events import Event, Finished, ReasoningDelta, TextDelta, TokenLogprob, ToolCallEvent


@dataclass
class ReplySummary:
    text: str
    reasoning: str
    calls: list[ToolCallEvent]
    logprobs: list[TokenLogprob]
    finish: Finished

    @classmethod
    def of(cls, events: list[Event]) -> ReplySummary:
        texts = [e for e in events if isinstance(e, TextDelta)]
        return cls(
            text="".join(e.text for e in texts),
            reasoning="".join(e.text for e in events if isinstance(e, ReasoningDelta)),
            calls=[e for e in events if isinstance(e, ToolCallEvent)],
            logprobs=[lp for e in texts for lp in e.logprobs],
            finish=next(e for e in events if isinstance(e, Finished)),
        )
