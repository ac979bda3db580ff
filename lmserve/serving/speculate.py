"""Speculative decoding: drafts of the next tokens that the scheduler verifies in one engine pass.

The scheduler feeds a sequence's last token and its draft to `Engine.verify` (one forward pass),
picks a token from each position's logits exactly as plain decoding would, and keeps the draft
while the picks agree with it: the first disagreement is replaced by the model's own pick, and
the cache is truncated back to the tokens taken. Whatever drafts, the reply is plain decoding's.

Drafters (`--speculate`):
- `ngram` (`PromptLookup`): a reply that copies (an edited file, a quoted passage, code echoed
  from the conversation) repeats runs of its prompt or of itself. The last n tokens (n = 3, then
  2, then 1) are looked up at their earlier occurrences in the prompt and reply so far, and what
  followed the one that also matches the most tokens before them (up to `CONTEXT`; the latest
  among equals) is the draft.
- `draft` (`ModelDrafter`, `--draft small.gguf`): a small model with the same tokenizer writes
  the draft greedily, from its own cache of the sequence.

A verify pass costs more than a decode step (on the NumPy engine up to a few single-row steps, on
a GPU little more than one), so drafting is kept to where it pays.
`PassCosts` learns, as the server runs, what each shape of pass costs on this engine (decode steps
by batch size, verify passes by batch size and width, both by context length), and a step is a
verify pass only when the tokens its drafts are expected to gain (each sequence's recent average)
make it yield more tokens a second than a decode step. A sequence whose draft gains nothing, or is
not worth its pass, pauses drafting for `PAUSE` tokens, twice as long each time that happens again
(at most `MAX_PAUSE`), and a draft accepted whole resets the pause: a reply with nothing to copy
pays for a few probes, not for a draft every step. A draft accepted in part leaves the pause as it
was, so that probes whose chance gains do not pay for their passes (a MoE's lone stream: a 4-row
pass costs three steps, and prose's 3-token matches mostly gain one) back off as misses do. After a
pause a sequence's next draft is tried whatever its past, so that a reply that starts copying late
is found, but with `PROBE` tokens at most: a verify pass's cost grows with its width (on the NumPy
engine 16 rows cost about six decode steps), and most probes of a reply with nothing to copy miss.
In a pass shared with other sequences a long draft widens it for all of them (the engine pads to
the longest list), so there a sequence only probes with `PROBE` tokens until a draft of it is
accepted whole. And prompt lookup drafts from a match shorter than 3 tokens only right after a
draft was accepted whole: in prose such matches are mostly chance, while most 3-token matches gain
a token (figures: docs/PERFORMANCE.md, measurements behind code choices).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from lmserve.engine.protocol import Engine
from lmserve.model.tokenizer import Tokenizer
from lmserve.serving.kv_slots import common_prefix

MODES = ("off", "ngram", "draft")
DEFAULT_MODE = "ngram"  # measured not to lose: scripts/bench_engine.py --speculate, docs/LMSERVER.md
NGRAM = 3  # trailing tokens a match needs (fewer only while copying)
CONTEXT = 8  # trailing tokens compared at most to choose between matches (the latest alone: fewer accepted)
# A reply that copies gains more from 15 than from 10 (figures: docs/PERFORMANCE.md, measurements
# behind code choices).
MAX_DRAFT = 15
MODEL_DRAFT = 4  # tokens a draft model writes at most per step (one small-model step each)
PROBE = 3  # the most a first draft (since a pause) holds, and in a shared pass any until one is accepted whole
PAUSE, MAX_PAUSE = 8, 256
COST_WEIGHT = 0.25  # of a new measurement in a pass shape's moving average
CATCH_UP = 256  # prompt tokens a draft model prefills per step before it drafts again


class Drafter:
    """What every drafter shares: the request's counts, and when to draft at all."""

    max_draft = MAX_DRAFT

    def __init__(self) -> None:
        self.drafted = 0  # tokens proposed over the request
        self.accepted = 0  # of them, the tokens the model agreed with
        self.copying = False  # the last draft was accepted whole
        self._pause = PAUSE
        self._resume_at = 0  # no draft before the sequence holds this many tokens
        self._gain: float | None = None  # tokens a draft recently gained on average (None: to be tried)

    @property
    def length(self) -> int:
        """Tokens in the sequence so far."""
        raise NotImplementedError

    def extend(self, token_ids: Sequence[int]) -> None:
        """Tokens now part of the sequence (each generated token, as it is taken)."""
        raise NotImplementedError

    def propose(self, limit: int) -> list[int]:
        """Up to `limit` (at least 1) tokens that may come next."""
        raise NotImplementedError

    def draft(self, limit: int, shared: bool = False) -> list[int]:
        """Up to `limit` tokens that may come next; [] while paused; PROBE at most for a first
        draft (since a pause) and, in a pass `shared` with other sequences, until a draft is
        accepted whole."""
        limit = min(limit, self.max_draft if self.copying or (self._gain is not None and not shared) else PROBE)
        if limit <= 0 or self.length < self._resume_at:
            return []
        return self.propose(limit)

    def expected_gain(self, length: int) -> float:
        """Tokens a draft of `length` is expected to gain: all of them until one has been tried."""
        return float(length) if self._gain is None else min(float(length), self._gain)

    def record(self, drafted: int, accepted: int) -> None:
        """What became of a draft: the request's counts, and whether to pause."""
        self.drafted += drafted
        self.accepted += accepted
        self.copying = accepted == drafted
        self._gain = accepted if self._gain is None else (self._gain + accepted) / 2
        if self.copying:
            self._pause = PAUSE
        if accepted:
            return
        self.hold()

    def hold(self) -> None:
        """Pause drafting (a draft gained nothing, or was not worth its pass); the next draft is
        tried whatever came before, as a probe: a sequence copying when the cost gate held its
        long draft would otherwise come back with MAX_DRAFT tokens counted as all gained, which
        an untimed pass shape lets through (a served MoE's four streams then ran a 64-row
        verify pass, 12 decode steps' time: figures in docs/PERFORMANCE.md)."""
        self._resume_at = self.length + self._pause
        self._pause = min(2 * self._pause, MAX_PAUSE)
        self._gain = None
        self.copying = False


class PassCosts:
    """Seconds each shape of engine pass takes here (moving averages by batch size, width (1 for
    a decode step) and context: the power of two of the most positions a cache of the pass holds),
    and whether a verify pass pays. Context is part of the shape: at 15,000 cached positions on a
    q8_0 cache, a verify pass cost far more decode steps than near the start, and costs learned on
    short prompts had a long agent prompt's reply verify drafts at 8.8 tok/s where decode steps
    alone made 27.9 (figures: docs/PERFORMANCE.md)."""

    def __init__(self) -> None:
        self._seconds: dict[tuple[int, int, int], float] = {}

    def record(self, batch: int, width: int, seconds: float, positions: int = 0) -> None:
        key = (batch, width, positions.bit_length())
        old = self._seconds.get(key)
        self._seconds[key] = seconds if old is None else old + COST_WEIGHT * (seconds - old)

    def pays(self, drafters: Sequence[Drafter | None], drafts: Sequence[Sequence[int]], positions: int = 0) -> bool | None:
        """Whether verifying these drafts yields more tokens a second than a decode step, by the
        drafts' expected gains; for a shape not yet measured, True (it is tried) unless a low
        estimate of its cost (`_estimate`) already yields less; None while a decode step of this
        batch and context has not been measured. `positions`: the most any of the caches holds."""
        batch, width, context = len(drafts), 1 + max(map(len, drafts)), positions.bit_length()
        decode, verify = self._seconds.get((batch, 1, context)), self._seconds.get((batch, width, context))
        if decode is None:
            return None
        gain = sum(d.expected_gain(len(x)) for d, x in zip(drafters, drafts, strict=True) if d is not None and x)
        if verify is None:  # tried, unless even a low estimate of its cost says it cannot pay
            return (batch + gain) / self._estimate(batch * width, context) > batch / decode
        return (batch + gain) / verify > batch / decode

    def _estimate(self, rows: int, context: int) -> float:
        """A low estimate of an untimed pass of `rows` rows at `context`, from the passes timed:
        the slowest with no more rows at no more context (a pass costs no less with more rows or
        positions), or the line through the two widest row counts below `rows` timed at this
        context, continued to `rows`, where that is more. Pass time grows about linearly with rows
        past the first few (a MoE's: each row reaches experts of its own) or less, so the estimate
        stays below the cost and a shape it rules out would not have paid: without it a served MoE
        tried a verify pass of each new width, batch and context, 16-20 rows at 4-15 decode steps'
        time, and lost a tenth of four streams' throughput to them (figures: docs/PERFORMANCE.md)."""
        no_wider = [(b * w, c, s) for (b, w, c), s in self._seconds.items() if b * w <= rows and c <= context]
        lowest = max((s for _, _, s in no_wider), default=0.0)
        here: dict[int, float] = {}  # row count -> its slowest shape at this context
        for r, c, s in no_wider:
            if c == context and r < rows:
                here[r] = max(s, here.get(r, 0.0))
        if len(here) < 2:
            return lowest
        (r1, s1), (r2, s2) = sorted(here.items())[-2:]
        return max(lowest, s2 + max(0.0, s2 - s1) / (r2 - r1) * (rows - r2))


class PromptLookup(Drafter):
    """Drafts what followed the earlier occurrence of the sequence's last tokens that matches
    the most of them (the latest among equals)."""

    def __init__(self, prompt_ids: Sequence[int]) -> None:
        super().__init__()
        self._ids = np.zeros(max(64, 2 * len(prompt_ids)), dtype=np.int64)
        self._n = 0
        self.extend(prompt_ids)

    @property
    def length(self) -> int:
        return self._n

    def extend(self, token_ids: Sequence[int]) -> None:
        end = self._n + len(token_ids)
        if end > len(self._ids):
            self._ids = np.concatenate([self._ids, np.zeros(max(end, len(self._ids)), dtype=np.int64)])
        self._ids[self._n:end] = token_ids
        self._n = end

    def propose(self, limit: int) -> list[int]:
        ids, last = self._ids[:self._n], self._n - 1
        ends = np.flatnonzero(ids[:last] == ids[last])  # earlier positions that end a 1-token match
        n = 1
        while len(ends) and n < min(CONTEXT, last):  # narrow to the longest match that occurs
            longer = ends[ends >= n]
            longer = longer[ids[longer - n] == ids[last - n]]
            if not len(longer):
                break
            ends, n = longer, n + 1
        if not len(ends) or (n < NGRAM and not self.copying):
            return []
        start = int(ends[-1]) + 1  # the latest occurrence: what followed it there
        return ids[start:start + limit].tolist()


class ModelDrafter(Drafter):
    """A small model's greedy continuation, from its own cache of the sequence: each step it
    catches up on the tokens taken since (rewinding past the draft tokens that were rejected)."""

    max_draft = MODEL_DRAFT

    def __init__(self, engine: Engine, prompt_ids: Sequence[int], ctx: int, vocab_size: int) -> None:
        super().__init__()
        self.engine = engine
        self.vocab_size = vocab_size  # the served model's: a draft model's padded rows never propose
        self._cache = engine.new_cache(ctx)
        self._tokens = list(prompt_ids)
        self._fed: list[int] = []  # what the draft cache holds

    @property
    def length(self) -> int:
        return len(self._tokens)

    def extend(self, token_ids: Sequence[int]) -> None:
        self._tokens += token_ids

    def propose(self, limit: int) -> list[int]:
        keep = min(common_prefix(self._fed, self._tokens), len(self._tokens) - 1)  # the last token is fed anew
        if keep < len(self._fed):
            self.engine.truncate(self._cache, keep)
            del self._fed[keep:]
        gap = self._tokens[keep:]
        if len(gap) > CATCH_UP:  # a long prompt: a chunk per step, so the batch never stalls on it
            self.engine.prefill(self._cache, gap[:CATCH_UP])
            self._fed += gap[:CATCH_UP]
            return []
        draft = [int(np.argmax(self.engine.prefill(self._cache, gap)[:self.vocab_size]))]
        self._fed += gap
        while len(draft) < limit:
            self._fed.append(draft[-1])
            token = int(self.engine.decode_argmax([self._cache], draft[-1:])[0])
            if token >= self.vocab_size:
                break
            draft.append(token)
        return draft


DrafterFactory = Callable[[Sequence[int]], Drafter]


def drafters(mode: str, ctx: int, vocab_size: int, draft_engine: Engine | None = None) -> DrafterFactory | None:
    """What makes each admitted sequence's drafter under `--speculate mode` (None: off)."""
    if mode == "ngram":
        return PromptLookup
    if mode == "draft":
        if draft_engine is None:
            raise ValueError("--speculate draft needs a draft model (--draft)")
        return lambda prompt_ids: ModelDrafter(draft_engine, prompt_ids, ctx, vocab_size)
    if mode != "off":
        raise ValueError(f"unknown --speculate mode {mode!r}")
    return None


def same_vocabulary(a: Tokenizer, b: Tokenizer) -> bool:
    """Whether two models' tokenizers give every id the same bytes (a draft model's must)."""
    return a.vocab_size == b.vocab_size and all(a.token_bytes(i) == b.token_bytes(i) for i in range(a.vocab_size))
