"""Reasoning budgets: one token budget for every reasoning format (`<think>` blocks, harmony's
analysis channel, Gemma 4's thought channel), whichever field of whichever dialect set it.

A request's budget comes from its own field (`thinking_token_budget`, Anthropic's
`thinking.budget_tokens`), else from its effort (`reasoning_effort`, `reasoning.effort`), else from
the server's `--reasoning-budget`. Budget 0 turns reasoning off: the template renders thinking off
where it can, and where it cannot (gpt-oss always reasons) the analysis message is closed as soon
as it opens. Whatever the source, thinking takes at most 3/4 of the reply
budget, and a reply a grammar governs (a forced call, an output format) keeps room for its
grammar's text after the reasoning, so that a forced call always arrives within `max_tokens`.
"""

from __future__ import annotations

import dataclasses

from lmserve.core.types import ChatRequest

UNLIMITED = -1  # no budget of its own: only the share of the reply budget bounds thinking
THINK_SHARE = 0.75  # thinking may use at most this share of max_tokens
GOVERNED_ROOM = 128  # tokens kept after reasoning for a governed reply's own text (a call, JSON)
# OpenAI's effort levels as budgets (none and minimal: no reasoning; xhigh: as high).
EFFORT_BUDGETS = {"none": 0, "minimal": 0, "low": 1024, "medium": 8192, "high": UNLIMITED, "xhigh": UNLIMITED}


def effort_budget(effort: str | None) -> int | None:
    """The budget an OpenAI effort level stands for; None when unset or unknown."""
    return EFFORT_BUDGETS.get(effort) if effort is not None else None


def settle(request: ChatRequest, server_budget: int) -> ChatRequest:
    """The request with its budget resolved (its own, else the server's; None: unlimited) and
    reasoning off where the budget is 0."""
    budget = request.thinking_budget if request.thinking_budget is not None else server_budget
    reasoning = False if budget == 0 else request.reasoning
    return dataclasses.replace(request, reasoning=reasoning, thinking_budget=None if budget == UNLIMITED else budget)


def think_budget(budget: int | None, max_tokens: int, governed: bool) -> int:
    """Tokens this reply may think before its think block is closed for it."""
    cap = int(max_tokens * THINK_SHARE)
    if governed:
        cap = min(cap, max_tokens - min(GOVERNED_ROOM, max_tokens))
    return cap if budget is None else min(budget, cap)
