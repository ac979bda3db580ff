"""Next-token selection on host logits, shared by every engine.

Order (as llama.cpp): logit bias, repetition penalties, then greedy argmax or
temperature -> top-k -> top-p -> min-p -> draw from a per-request seeded generator.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import numpy as np

from lmserve.core.events import TokenLogprob, TopLogprob
from lmserve.core.types import SamplingParams


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max()
    return shifted - np.log(np.exp(shifted).sum())


NUCLEUS_FIRST = 64  # the largest weights ordered first; four times as many while they fall short


def _nucleus(weights: np.ndarray, top_p: float) -> np.ndarray:
    """Indices of the fewest largest `weights` whose share of the total reaches `top_p`, largest
    first, equal weights by index (a stable sort of all of them would give the same). Ordered a
    few at a time: the nucleus is accepted only if it ends before the last of those ordered, on
    a weight above theirs, so none left unordered could belong or come first."""
    threshold = top_p * weights.sum()
    count = NUCLEUS_FIRST
    while True:
        if count >= weights.size:
            order = np.argsort(-weights, kind="stable")
        else:
            best = np.sort(np.argpartition(-weights, count)[:count])
            order = best[np.argsort(-weights[best], kind="stable")]
        end = int(np.searchsorted(np.cumsum(weights[order]), threshold)) + 1
        if order.size == weights.size:
            return order[:min(end, order.size)]
        if end < order.size and weights[order[end - 1]] > weights[order[-1]]:
            return order[:end]
        count *= 4


def _draw(rng: np.random.Generator, weights: np.ndarray) -> int:
    """An index drawn with probability proportional to `weights`: what `rng.choice(n, p=...)` does
    (one uniform draw against the cumulative weights) without its checks of `p`, which cost a
    sizeable share of a pick on a full vocabulary (figures: docs/PERFORMANCE.md, measurements
    behind code choices)."""
    cumulative = np.cumsum(weights)
    return min(int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right")), weights.size - 1)


class Sampler:
    """One request's sampling state: its parameters, its random generator, its token history."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int] | None = None) -> None:
        self.params = params
        # OpenAI's seeds span int64; NumPy takes non-negative ones: fold negatives into that range.
        self.rng = np.random.default_rng(None if params.seed is None else params.seed % 2**64)
        self._recent: list[int] = list(prompt_ids or [])[-params.repeat_last_n:] if params.repeat_last_n else []
        self._counts: Counter[int] = Counter()
        if params.logit_bias:
            self._bias_ids = np.fromiter(params.logit_bias.keys(), dtype=np.int64)
            self._bias_values = np.fromiter(params.logit_bias.values(), dtype=np.float32)

    def adjust(self, logits: np.ndarray) -> np.ndarray:
        """Bias and penalties applied to a copy of the logits (the distribution logprobs report)."""
        p = self.params
        if not (p.logit_bias or p.repeat_penalty != 1.0 or p.presence_penalty or p.frequency_penalty):
            return logits
        logits = logits.astype(np.float32, copy=True)
        if p.logit_bias:
            logits[self._bias_ids] += self._bias_values
        if p.repeat_penalty != 1.0 and self._recent:
            ids = np.unique(np.asarray(self._recent))
            vals = logits[ids]
            logits[ids] = np.where(vals > 0, vals / p.repeat_penalty, vals * p.repeat_penalty)
        if (p.presence_penalty or p.frequency_penalty) and self._counts:
            ids = np.fromiter(self._counts.keys(), dtype=np.int64)
            counts = np.fromiter(self._counts.values(), dtype=np.float32)
            logits[ids] -= counts * p.frequency_penalty + p.presence_penalty
        return logits

    def pick(self, logits: np.ndarray) -> int:
        """Choose the next token from already adjusted logits. Only top_p orders tokens, and only
        the few largest as a rule (`_nucleus`): a full sort of a vocabulary's logits every token
        costs a large share of a decode step (figures: docs/PERFORMANCE.md, measurements behind
        code choices)."""
        p = self.params
        if p.greedy:
            return int(np.argmax(logits))
        # Shift before scaling: a denormal temperature then sends the rest to -inf, never inf - inf.
        scaled = (logits.astype(np.float64) - logits.max()) / p.temperature
        candidates = np.arange(scaled.size)
        if 0 < p.top_k < scaled.size:
            candidates = np.sort(np.argpartition(-scaled, p.top_k)[: p.top_k])
        weights = np.exp(scaled[candidates])  # the best is among them: its weight is 1
        chosen = _nucleus(weights, p.top_p) if p.top_p < 1.0 else np.arange(weights.size)
        if p.min_p > 0.0:  # the tokens at least min_p times the best (the best itself at least)
            kept = chosen[weights[chosen] >= p.min_p * weights.max()]
            chosen = kept if kept.size else chosen[np.argmax(weights[chosen])][None]
        return int(candidates[chosen[_draw(self.rng, weights[chosen])]])

    def accept(self, token_id: int) -> None:
        """Record a generated token for the penalties."""
        if self.params.repeat_last_n:
            self._recent.append(token_id)
            if len(self._recent) > self.params.repeat_last_n:
                del self._recent[0]
        self._counts[token_id] += 1

    def sample(self, logits: np.ndarray) -> tuple[int, np.ndarray]:
        """Adjust, pick and record; returns the token and the adjusted logits."""
        adjusted = self.adjust(logits)
        token = self.pick(adjusted)
        self.accept(token)
        return token, adjusted


def token_logprob(
    adjusted: np.ndarray, token_id: int, top_n: int, piece: Callable[[int], str], token_bytes: Callable[[int], bytes]
) -> TokenLogprob:
    """OpenAI-shaped log-probability of the chosen token and the `top_n` most likely tokens."""
    lp = log_softmax(adjusted.astype(np.float64))
    top: list[TopLogprob] = []
    if top_n > 0:
        best = np.argpartition(-lp, top_n)[:top_n]
        best = best[np.argsort(-lp[best], kind="stable")]
        top = [TopLogprob(piece(int(i)), float(lp[i]), list(token_bytes(int(i)))) for i in best]
    return TokenLogprob(piece(token_id), float(lp[token_id]), list(token_bytes(token_id)), top)
