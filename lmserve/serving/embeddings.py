"""Embeddings: one vector per input, pooled from an engine's final hidden states (`Engine.embed`).

An embedding model's GGUF says how its per-position states become one vector
(`ModelConfig.pooling`, llama.cpp's `<arch>.pooling_type`, which llama.cpp's converter copies from
sentence-transformers' 1_Pooling config): `last` (Qwen3-Embedding and other decoder models: under
causal attention only the last position has read the whole input), `mean` (most BERT-style
models), `cls` (the first position's, BERT's [CLS]). A file without the key is a generative model,
whose last position is likewise the only one that has read everything: it is pooled as `last`.
`none` (per-token vectors) and `rank` (a reranker's score) give no single embedding and are refused.

The pooled vector is L2-normalized, as Qwen3-Embedding's own pipeline (its Normalize module) and
llama-server (`--embd-normalize 2`, its default) do: a dot product of two is then their cosine
similarity, which is what OpenAI's embeddings give and what clients of `/v1/embeddings` compute.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from lmserve.engine.protocol import Engine
from lmserve.model.config import EMBEDDING_POOLINGS, ModelConfig

LAST, MEAN, CLS = "last", "mean", "cls"  # EMBEDDING_POOLINGS, by name


def check_pooling(pooling: str | None) -> None:
    """ValueError, naming it, for a pooling that gives no single embedding per input (`none`,
    `rank`, a value llama.cpp has no name for); None, a generative model's, is pooled as `last`."""
    if pooling is not None and pooling not in EMBEDDING_POOLINGS:
        raise ValueError(f"the model's pooling '{pooling}' gives no single embedding per input "
                         f"(an embedding model's is {LAST}, {MEAN} or {CLS})")


def pool(hidden: np.ndarray, pooling: str | None) -> np.ndarray:
    """One float32 vector `[hidden]` from one input's final hidden states `[n, hidden]`: the last
    position's (`last`, and None: a model whose file names no pooling), their mean (`mean`) or the
    first position's (`cls`). ValueError for another pooling (`check_pooling`) or no positions."""
    check_pooling(pooling)
    if hidden.ndim != 2 or not len(hidden):
        raise ValueError(f"pooling needs hidden states [n >= 1, hidden], not {list(hidden.shape)}")
    if pooling is None or pooling == LAST:
        return hidden[-1].astype(np.float32)
    if pooling == MEAN:
        return hidden.mean(axis=0, dtype=np.float64).astype(np.float32)  # summed in float64: no drift with n
    return hidden[0].astype(np.float32)  # CLS


def normalize(v: np.ndarray) -> np.ndarray:
    """`v` scaled to unit L2 norm along its last axis (float32), so that a dot product of two is
    their cosine; a zero vector stays zero (as llama.cpp's common_embd_normalize leaves it)."""
    v = np.asarray(v, dtype=np.float32)
    norm = np.linalg.norm(v.astype(np.float64), axis=-1, keepdims=True)
    return (v / np.where(norm > 0, norm, 1.0)).astype(np.float32)


def embed_tokens(engine: Engine, token_ids: Sequence[int], config: ModelConfig | None = None,
                 normalized: bool = True) -> np.ndarray:
    """One input's embedding `[hidden]` (float32): the engine's final hidden states of `token_ids`
    (a pass of its own, leaving every cache as it was), pooled as `config` says (default: the
    engine's own model's) and L2-normalized unless `normalized` is False. ValueError for no tokens,
    an id outside the vocabulary, or a model whose pooling gives no single embedding; the pooling
    is checked first, so such a model runs no pass."""
    pooling = (config or engine.config).pooling
    check_pooling(pooling)
    pooled = pool(engine.embed(token_ids), pooling)
    return normalize(pooled) if normalized else pooled
