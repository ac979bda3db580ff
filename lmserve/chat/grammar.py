"""Grammar-constrained decoding with llguidance, shared by every engine.

A grammar is compiled once per source (llguidance walks the vocabulary to build its token trie, so
the tokenizer is built on first use and compiled grammars are cached) and copied per sequence. Each
decode step the sequence's constraint computes llguidance's token bitmask and sets every token it
forbids to -inf in the host logits before sampling, then consumes the sampled token.

llguidance is handed each token's bytes as the reply router sees them, special (control and
end-of-generation) tokens marked as such. Read from the tokenizer's JSON instead, it takes every
added token for a special one, USER_DEFINED tokens too (Gemma 4's `<|tool_call>` and `<|"|>`, real
Qwen3 files' `<tool_call>`), and a special token never matches a grammar's text: the model's own
marker token would be masked out. Matched by their text they mean what the router reads, as in
llama.cpp's own grammar sampler.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Protocol

import llguidance
import llguidance.numpy as llnp
import numpy as np

from lmserve.model.tokenizer import Tokenizer

CACHE_SIZE = 64


class GrammarError(Exception):
    """A grammar or schema llguidance cannot compile; the message is llguidance's own."""


class Constraint(Protocol):
    """Per-sequence decoding constraint: mask before sampling, consume after."""

    @property
    def finished(self) -> bool: ...

    def mask(self, logits: np.ndarray) -> np.ndarray: ...

    def consume(self, token: int) -> None: ...


def _masked(logits: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """A copy of `logits` with every token not in the boolean `allowed` set to -inf (rows past
    the tokenizer's vocabulary, where an engine pads its output, are never allowed)."""
    out = np.full(logits.shape, -np.inf, dtype=np.float32)
    n = min(allowed.size, logits.size)
    np.copyto(out[:n], logits[:n], where=allowed[:n])
    return out


class GrammarConstraint:
    """One sequence's position in a compiled grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._bitmask = llnp.allocate_token_bitmask(1, vocab_size)

    @property
    def finished(self) -> bool:
        """Nothing but end-of-turn may follow (or the matcher failed: stop constraining)."""
        return self._matcher.is_stopped() or self._matcher.is_error()

    def mask(self, logits: np.ndarray) -> np.ndarray:
        llnp.fill_next_token_bitmask(self._matcher, self._bitmask)
        allowed = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")[: self._vocab_size]
        return _masked(logits, allowed.view(bool))

    def consume(self, token: int) -> None:
        self._matcher.consume_token(token)


class ForcedTokens:
    """A fixed token sequence the model must emit next (closing a think block over budget). A
    constraint `under` it (the grammar governing the reply) consumes the tokens too."""

    def __init__(self, ids: list[int], under: Constraint | None = None) -> None:
        self._ids = list(ids)
        self._under = under

    @property
    def finished(self) -> bool:
        return not self._ids

    def mask(self, logits: np.ndarray) -> np.ndarray:
        out = np.full(logits.shape, -np.inf, dtype=np.float32)
        out[self._ids[0]] = logits[self._ids[0]]
        return out

    def consume(self, token: int) -> None:
        if self._ids and token == self._ids[0]:
            del self._ids[0]
        if self._under is not None:
            self._under.consume(token)


class Excluding:
    """Every token but `ids` (end-of-turn, while a grammar that must still come waits)."""

    finished = False

    def __init__(self, ids: frozenset[int]) -> None:
        self._ids = sorted(ids)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        out = logits.copy()
        out[self._ids] = -np.inf
        return out

    def consume(self, token: int) -> None:
        pass


class _Vocabulary:
    """The tokenizer as llguidance's TokenizerWrapper takes it: token bytes (special ones behind
    llguidance's 0xFF mark), and text -> ids with special tokens parsed (priming a call grammar
    with text that holds a control-token opener)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        special = tokenizer.special_ids
        self.tokens = [b"\xff" + tokenizer.token_bytes(i) if i in special else tokenizer.token_bytes(i)
                       for i in range(tokenizer.vocab_size)]
        self.special_token_ids = sorted(special)
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self._tokenizer = tokenizer

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special=False, parse_special=True)


class CompiledGrammar:
    """A compiled grammar in its start state; each sequence gets its own copy."""

    def __init__(self, matcher: llguidance.LLMatcher, ll_tokenizer: llguidance.LLTokenizer, vocab_size: int,
                 lock: threading.Lock) -> None:
        self._matcher = matcher
        self._ll = ll_tokenizer
        self._vocab_size = vocab_size
        self._lock = lock

    def constraint(self, prefix: bytes = b"") -> GrammarConstraint | None:
        """A fresh constraint that has already consumed `prefix` (text the model wrote before the
        grammar took over); None when the prefix does not fit the grammar."""
        with self._lock:
            matcher = self._matcher.deep_copy()
        if prefix and not matcher.consume_tokens(self._ll.tokenize_bytes(prefix, parse_special=True)):
            return None
        return GrammarConstraint(matcher, self._vocab_size)


def clean_error(message: str) -> str:
    """llguidance's message for the client: an internal panic (a grammar past its limits, such as
    thousands of tools) loses its Rust backtrace and says what happened in words."""
    if "panic" not in message and "<backtrace>" not in message:
        return message
    first = message.split("<backtrace>")[0].strip().splitlines()[0]
    return f"the grammar engine could not compile this grammar (too large or too complex: {first})"


class Grammars:
    """The model's llguidance tokenizer and an LRU cache of compiled grammars keyed by source."""

    def __init__(self, tokenizer: Tokenizer, cache_size: int = CACHE_SIZE) -> None:
        self._tokenizer = tokenizer
        self._cache_size = cache_size
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._ll: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll is None:
                tok = self._tokenizer
                self._ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary(tok)),
                                                  n_vocab=tok.vocab_size, eos_token=sorted(tok.eog_ids) or None)
            return self._ll

    def compile(self, grammar: str) -> CompiledGrammar:
        """A compiled llguidance grammar (from `llguidance.grammar_from` and friends); raises
        GrammarError with llguidance's message when it does not compile."""
        with self._lock:
            hit = self._cache.get(grammar)
            if hit is not None:
                self._cache.move_to_end(grammar)
                return hit
        ll = self.ll_tokenizer
        matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(clean_error(matcher.get_error()))
        compiled = CompiledGrammar(matcher, ll, self._tokenizer.vocab_size, self._lock)
        with self._lock:
            self._cache[grammar] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled
