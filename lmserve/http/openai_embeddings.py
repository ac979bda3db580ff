"""OpenAI's `/v1/embeddings`: parse a body into token-id inputs, render vectors as OpenAI does.

`input` is a string, a list of strings, a list of token ids or a list of such lists (at most
MAX_INPUTS); strings are tokenized with the model's special tokens (its BOS/EOS as its GGUF asks,
as llama-server does) and never parse control tokens out of user text. `encoding_format` `float`
gives JSON numbers, `base64` the little-endian float32 bytes the OpenAI SDKs decode. `dimensions`
keeps the first N components and normalizes them again (Matryoshka-trained models such as
Qwen3-Embedding lose little; for other models it is the caller's choice).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from msgspec import Struct

from lmserve.core.errors import invalid
from lmserve.http.structs import decode

MAX_INPUTS = 2048  # OpenAI's own limit on inputs per request


class EmbeddingsBody(Struct):
    input: Any
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


@dataclass
class EmbeddingsCall:
    inputs: list[list[int]]
    encoding_format: str
    dimensions: int | None


def parse_embeddings(body: dict[str, Any], tokenizer: Any, hidden: int) -> EmbeddingsCall:
    """The body's inputs as token ids (CPU work: tokenizing; any thread); 400 naming the field."""
    parsed = decode(body, EmbeddingsBody)
    if parsed.dimensions is not None and not 1 <= parsed.dimensions <= hidden:
        raise invalid("dimensions", f"must be between 1 and the model's {hidden}")
    return EmbeddingsCall(_inputs(parsed.input, tokenizer), parsed.encoding_format, parsed.dimensions)


def _inputs(value: Any, tokenizer: Any) -> list[list[int]]:
    shape = "a string, a list of strings, a list of token ids or a list of lists of token ids"
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise invalid("input", f"must be {shape}, and not empty")
    if len(value) > MAX_INPUTS:
        raise invalid("input", f"holds {len(value)} inputs; at most {MAX_INPUTS}")
    if all(isinstance(v, str) for v in value):
        return [tokenizer.encode(text, add_special=True, parse_special=False) for text in value]
    if all(_is_id(v) for v in value):
        value = [value]
    if not all(isinstance(v, list) and all(_is_id(i) for i in v) for v in value):
        raise invalid("input", f"must be {shape}")
    vocab = tokenizer.vocab_size
    for i, ids in enumerate(value):
        if any(t >= vocab for t in ids):
            raise invalid(f"input[{i}]", f"holds a token id outside the vocabulary (0 to {vocab - 1})")
    return value


def _is_id(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def render_embeddings(call: EmbeddingsCall, vectors: list[np.ndarray], model_id: str) -> dict[str, Any]:
    tokens = sum(len(ids) for ids in call.inputs)
    return {"object": "list", "model": model_id,
            "data": [{"object": "embedding", "index": i, "embedding": _encoded(v, call)} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _encoded(vector: np.ndarray, call: EmbeddingsCall) -> list[float] | str:
    if call.dimensions is not None:
        vector = truncated(vector, call.dimensions)
    if call.encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.astype(np.float32).tolist()


def truncated(vector: np.ndarray, dimensions: int) -> np.ndarray:
    """The first `dimensions` components, at unit length again."""
    head = vector[:dimensions].astype(np.float64)
    norm = np.linalg.norm(head)
    return (head / norm if norm > 0 else head).astype(np.float32)
