"""Startup sizing against memory: the default context, and --kv-slots clamped when they cannot fit.

One slot is priced at the full context (bytes per cached token from the model's KV geometry and
the engine's cache dtype), since any slot may fill that far, plus, for a hybrid model, its
recurrent state and every checkpoint it may keep (each one full state, whatever the length). On a
Mac, memory is unified: the available figure psutil reports is what weights and KV share.
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil

from lmserve.engine.protocol import Engine

CTX_STEP = 4096  # a context that must shrink to fit is a multiple of this


@dataclass(frozen=True)
class ContextChoice:
    tokens: int
    reason: str  # for the banner


def slot_state_bytes(engine: Engine) -> int:
    """What a slot costs beside its keys and values: a hybrid cache's current recurrent state and
    its checkpoints (0 for attention-only models)."""
    return engine.state_bytes() * (engine.checkpoints_per_cache + 1)


def default_context(trained: int, per_token: int, available: int | None = None,
                    state_bytes: int = 0) -> ContextChoice:
    """The model's trained context when one full KV slot of it (and `state_bytes`, a hybrid
    slot's recurrent states) fits in half the available memory (what `plan_slots` keeps
    comfortable, with the weights already resident), else the largest multiple of CTX_STEP that
    does (at least one step, or the trained context when smaller)."""
    available = psutil.virtual_memory().available if available is None else available
    budget = available // 2 - state_bytes
    if trained * per_token <= budget:
        return ContextChoice(trained, "the model's trained context; one full KV slot fits in memory")
    fits = max(CTX_STEP, max(budget, 0) // per_token // CTX_STEP * CTX_STEP)
    tokens = min(trained, fits)
    return ContextChoice(tokens, f"the largest multiple of {CTX_STEP} whose KV slot fits in half of the "
                                 f"{available / 2**30:.1f} GiB available (trained {trained}; raise with --ctx)")


@dataclass(frozen=True)
class SlotBudget:
    slots: int  # the slot count to use
    asked: int
    per_slot: int  # bytes one full slot costs
    available: int
    warning: str | None = None
    clamped: bool = False


def plan_slots(asked: int, per_token: int, ctx: int, available: int | None = None,
               pending_weights: int = 0, force: bool = False, state_bytes: int = 0) -> SlotBudget:
    """Compare `asked` full slots (each `ctx` positions and `state_bytes` of recurrent states,
    + weights not yet resident) with available memory. Above half of it: a warning with the
    arithmetic. Above all of it: clamp to what fits in half (at least one slot), unless `force`."""
    available = psutil.virtual_memory().available if available is None else available
    per_slot = per_token * ctx + state_bytes
    need = asked * per_slot + pending_weights
    mib = 1024 * 1024
    states = f" + {state_bytes / mib:.0f} MiB recurrent states" if state_bytes else ""
    arithmetic = (f"{asked} KV slots x {per_slot / mib:.0f} MiB ({ctx} tokens x {per_token} bytes{states})"
                  + (f" + {pending_weights / mib:.0f} MiB weights" if pending_weights else "")
                  + f" = {need / mib:.0f} MiB, with {available / mib:.0f} MiB of memory available")
    if need <= available / 2:
        return SlotBudget(asked, asked, per_slot, available)
    if need <= available or force:
        verdict = "more than half of it" if need <= available else "more than all of it (kept: --kv-slots-force)"
        return SlotBudget(asked, asked, per_slot, available, f"{arithmetic}: {verdict}")
    fits = max(1, int((available / 2 - pending_weights) // per_slot))
    return SlotBudget(fits, asked, per_slot, available,
                      f"{arithmetic}: more than all of it; using {fits} slot(s), which fit in half "
                      "(--kv-slots-force keeps the asked count)", clamped=True)
