"""Sampling: greedy, seeds, truncation filters, penalties and logprobs."""

from __future__ import annotations

import numpy as np

from lmserve.core.types import SamplingParams
from lmserve.serving.sampling import Sampler, token_logprob

LOGITS = np.array([1.0, 3.0, 2.0, 0.5, 2.9], dtype=np.float32)


def draws(params: SamplingParams, n: int = 50) -> list[int]:
    sampler = Sampler(params)
    return [sampler.pick(LOGITS) for _ in range(n)]


def test_greedy_picks_argmax():
    assert draws(SamplingParams(temperature=0.0), 3) == [1, 1, 1]


def test_same_seed_same_tokens_and_different_seed_differs():
    a = draws(SamplingParams(temperature=1.5, seed=7))
    assert a == draws(SamplingParams(temperature=1.5, seed=7))
    assert a != draws(SamplingParams(temperature=1.5, seed=8))


def test_top_k_and_top_p_and_min_p_restrict_candidates():
    assert set(draws(SamplingParams(temperature=2.0, top_k=2, seed=1), 200)) <= {1, 4}
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.01, seed=1), 50)) == {1}
    assert set(draws(SamplingParams(temperature=2.0, min_p=0.5, seed=1), 200)) <= {1, 4, 2}


def test_logit_bias_and_penalties_change_the_choice():
    sampler = Sampler(SamplingParams(temperature=0.0, logit_bias={0: 100.0}))
    assert sampler.sample(LOGITS)[0] == 0
    sampler = Sampler(SamplingParams(temperature=0.0, presence_penalty=2.0))
    assert [sampler.sample(LOGITS)[0] for _ in range(2)] == [1, 4]
    sampler = Sampler(SamplingParams(temperature=0.0, repeat_penalty=2.0), prompt_ids=[1])
    assert sampler.sample(LOGITS)[0] == 4


def test_logprob_shape_and_normalization():
    lp = token_logprob(LOGITS, 1, 3, lambda i: f"t{i}", lambda i: f"t{i}".encode())
    assert lp.token == "t1" and lp.bytes == list(b"t1")
    assert [t.token for t in lp.top] == ["t1", "t4", "t2"]
    total = np.exp(LOGITS - LOGITS.max()).sum()
    assert abs(lp.logprob - float(np.log(np.exp(3.0 - 3.0) / total))) < 1e-6
