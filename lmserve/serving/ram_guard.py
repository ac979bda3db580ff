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


class MemoryRefusal(Exception):
    """Not even one KV slot of the context fits in the memory available (no --kv-slots-force)."""


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
    if per_slot + pending_weights > available:
        largest = largest_context(per_token, available - pending_weights, state_bytes)
        raise MemoryRefusal(f"{arithmetic}: not even one slot of {ctx} tokens fits; "
                            + (f"at most --ctx {largest} does" if largest else "no context does")
                            + " (--kv-slots-force starts anyway)")
    fits = max(1, int((available / 2 - pending_weights) // per_slot))
    where = "in half" if fits * per_slot + pending_weights <= available / 2 else "in memory, above half of it"
    return SlotBudget(fits, asked, per_slot, available,
                      f"{arithmetic}: more than all of it; using {fits} slot(s), which fit {where} "
                      "(--kv-slots-force keeps the asked count)", clamped=True)


def largest_context(per_token: int, room: float, state_bytes: int = 0) -> int:
    """The most tokens one slot may hold in `room` bytes (0: none)."""
    return max(0, int((room - state_bytes) // per_token))


def fit_report(weight_bytes: int, per_token: int, state_bytes: int, ctx: int, slots: int,
               available: int | None = None) -> dict[str, int | bool]:
    """The RAM guard's arithmetic for a context and slot count, for `GET /fit`: what one slot
    costs, how many fit comfortably (half the memory left beside the weights, already resident)
    and at all, and the largest context one slot and `slots` slots can hold."""
    available = psutil.virtual_memory().available if available is None else available
    per_slot = per_token * ctx + state_bytes
    return {"weight_bytes": weight_bytes, "kv_bytes_per_token": per_token, "state_bytes_per_slot": state_bytes,
            "ctx": ctx, "slots": slots, "bytes_per_slot": per_slot, "kv_bytes": per_slot * slots,
            "available_bytes": available, "fits": per_slot * slots <= available,
            "comfortable": per_slot * slots <= available // 2,
            "slots_that_fit": available // per_slot, "slots_that_fit_comfortably": available // 2 // per_slot,
            "largest_ctx_one_slot": largest_context(per_token, available, state_bytes),
            "largest_ctx_all_slots": largest_context(per_token, available / max(slots, 1), state_bytes)}
