"""Sampling: greedy, seeds, truncation filters, penalties and logprobs.

The draws are checked as a distribution: over many seeded draws the empirical frequencies must
match the softmax of the (temperature-scaled, truncated, renormalized) logits, every allowed token
must turn up and no other. An argmax sampler, or one that ignores a filter, fails these.
"""

from __future__ import annotations

import numpy as np
import pytest

from lmserve.core.types import SamplingParams
from lmserve.serving.sampling import Sampler, _nucleus, token_logprob

pytestmark = pytest.mark.fast  # in-process: part of `scripts/test.sh -m fast`

LOGITS = np.array([1.0, 3.0, 2.0, 0.5, 2.9], dtype=np.float32)
# softmax(LOGITS) ~ [0.054, 0.402, 0.148, 0.033, 0.363]: by rank 1, 4, 2, 0, 3, cumulative
# 0.402, 0.765, 0.913, 0.967, 1.0; relative to the best 1, 0.905, 0.368, 0.135, 0.082.
N = 20_000
# One frequency over N draws has a standard deviation of at most sqrt(0.25 / N) ~ 0.0035; 0.02 is
# over 5 of them, and the seeds make every run draw the same tokens anyway.
TOL = 0.02


def draws(params: SamplingParams, n: int = 50) -> list[int]:
    sampler = Sampler(params)
    return [sampler.pick(LOGITS) for _ in range(n)]


def frequencies(params: SamplingParams, n: int = N) -> np.ndarray:
    return np.bincount(draws(params, n), minlength=LOGITS.size) / n


def softmax(logits: np.ndarray, temperature: float = 1.0, keep: set[int] | None = None) -> np.ndarray:
    """The distribution the sampler should draw from: `keep` restricts and renormalizes."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    if keep is not None:
        p[[i for i in range(p.size) if i not in keep]] = 0.0
    return p / p.sum()


def assert_draws_follow(freq: np.ndarray, expected: np.ndarray) -> None:
    allowed = set(np.flatnonzero(expected).tolist())
    assert set(np.flatnonzero(freq).tolist()) == allowed, (freq, expected)  # all of them, none other
    assert np.abs(freq - expected).max() < TOL, (freq.round(4), expected.round(4))


def test_greedy_picks_argmax():
    assert draws(SamplingParams(temperature=0.0), 3) == [1, 1, 1]
    assert draws(SamplingParams(temperature=1.0, top_k=1, seed=5), 20) == [1] * 20  # top_k 1 is greedy


def test_same_seed_same_tokens_and_different_seed_differs():
    a = draws(SamplingParams(temperature=1.5, seed=7))
    assert a == draws(SamplingParams(temperature=1.5, seed=7))
    assert a != draws(SamplingParams(temperature=1.5, seed=8))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_draws_follow_the_tempered_softmax(temperature):
    assert_draws_follow(frequencies(SamplingParams(temperature=temperature, seed=11)),
                        softmax(LOGITS, temperature))


def test_temperature_sharpens_and_flattens():
    cold, warm, hot = (frequencies(SamplingParams(temperature=t, seed=3)) for t in (0.5, 1.0, 2.0))
    # the best token gains as the temperature falls, the least likely loses
    assert cold[1] > warm[1] + 0.05 and warm[1] > hot[1] + 0.05  # 0.51, 0.40, 0.31
    assert cold[3] < warm[3] < hot[3] and hot[3] > 0.05
    # and the spread (entropy) grows with the temperature
    entropy = [-(f[f > 0] * np.log(f[f > 0])).sum() for f in (cold, warm, hot)]
    assert entropy[0] < entropy[1] < entropy[2]


@pytest.mark.parametrize(("top_k", "allowed"), [(2, {1, 4}), (3, {1, 4, 2}), (4, {1, 4, 2, 0})])
def test_top_k_draws_exactly_the_k_best(top_k, allowed):
    freq = frequencies(SamplingParams(temperature=2.0, top_k=top_k, seed=1))
    assert_draws_follow(freq, softmax(LOGITS, 2.0, allowed))


@pytest.mark.parametrize(("top_p", "nucleus"), [
    (0.3, {1}), (0.75, {1, 4}), (0.8, {1, 4, 2}), (0.95, {1, 4, 2, 0}), (0.99, {0, 1, 2, 3, 4}),
])
def test_top_p_draws_exactly_the_nucleus(top_p, nucleus):
    # the nucleus is the smallest set of best tokens whose probabilities reach top_p
    freq = frequencies(SamplingParams(temperature=1.0, top_p=top_p, seed=2))
    assert_draws_follow(freq, softmax(LOGITS, 1.0, nucleus))


@pytest.mark.parametrize(("min_p", "allowed"), [
    (0.95, {1}), (0.5, {1, 4}), (0.3, {1, 4, 2}), (0.1, {1, 4, 2, 0}), (0.05, {0, 1, 2, 3, 4}),
])
def test_min_p_draws_tokens_at_least_min_p_times_the_best(min_p, allowed):
    freq = frequencies(SamplingParams(temperature=1.0, min_p=min_p, seed=4))
    assert_draws_follow(freq, softmax(LOGITS, 1.0, allowed))


def test_filters_see_the_tempered_distribution():
    # The module's order: temperature first, then the filters. At 2.0 token 2's probability is 0.61
    # of the best (0.37 at 1.0), so min_p 0.5 keeps it; the best token has 0.31 (0.40 at 1.0), so
    # top_p 0.35 needs the second best too.
    assert_draws_follow(frequencies(SamplingParams(temperature=2.0, min_p=0.5, seed=6)),
                        softmax(LOGITS, 2.0, {1, 4, 2}))
    assert_draws_follow(frequencies(SamplingParams(temperature=2.0, top_p=0.35, seed=6)),
                        softmax(LOGITS, 2.0, {1, 4}))


def test_filters_combine_as_the_narrowest():
    freq = frequencies(SamplingParams(temperature=1.0, top_k=4, top_p=0.8, min_p=0.3, seed=9))
    assert_draws_follow(freq, softmax(LOGITS, 1.0, {1, 4, 2}))
    freq = frequencies(SamplingParams(temperature=1.0, top_k=3, top_p=0.99, min_p=0.5, seed=9))
    assert_draws_follow(freq, softmax(LOGITS, 1.0, {1, 4}))


# -- penalties and bias: exact amounts on exact logits ------------------------------------------------


def test_logit_bias_adds_exactly_the_bias():
    sampler = Sampler(SamplingParams(temperature=0.0, logit_bias={0: 100.0, 3: -1.5}))
    original = LOGITS.copy()
    token, adjusted = sampler.sample(LOGITS)
    assert token == 0
    np.testing.assert_allclose(adjusted, LOGITS + np.array([100.0, 0, 0, -1.5, 0]), rtol=0, atol=1e-5)
    np.testing.assert_array_equal(LOGITS, original)  # the caller's logits are left alone


def test_presence_and_frequency_penalties_subtract_per_generated_token():
    sampler = Sampler(SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25),
                      prompt_ids=[2, 2, 2])  # the prompt does not count: only generated tokens do
    np.testing.assert_array_equal(sampler.adjust(LOGITS), LOGITS)
    for token in (1, 1, 1, 4):
        sampler.accept(token)
    # token 1: seen 3 times -> 0.5 + 3 * 0.25 = 1.25; token 4: once -> 0.5 + 0.25 = 0.75
    expected = LOGITS - np.array([0, 1.25, 0, 0, 0.75], dtype=np.float32)
    np.testing.assert_allclose(sampler.adjust(LOGITS), expected, rtol=0, atol=1e-6)


def test_presence_penalty_changes_the_greedy_choice():
    sampler = Sampler(SamplingParams(temperature=0.0, presence_penalty=2.0))
    # 1 (3.0) is chosen, then pays 2.0 -> 1.0 and loses to 4 (2.9); 4 then pays too -> 2 (2.0)
    assert [sampler.sample(LOGITS)[0] for _ in range(3)] == [1, 4, 2]


def test_repeat_penalty_divides_positive_and_multiplies_negative_logits():
    logits = np.array([1.0, 3.0, -2.0, 0.5, 2.9], dtype=np.float32)
    sampler = Sampler(SamplingParams(temperature=0.0, repeat_penalty=2.0, repeat_last_n=3),
                      prompt_ids=[3, 1, 2, 1])  # the window holds the last 3: 1, 2, 1 (token 3 fell out)
    token, adjusted = sampler.sample(logits)
    np.testing.assert_allclose(adjusted, [1.0, 1.5, -4.0, 0.5, 2.9], rtol=0, atol=1e-6)  # once per id
    assert token == 4
    # 4 joins the window and pushes the oldest (1) out: now 2, 1, 4 are penalized
    np.testing.assert_allclose(sampler.adjust(logits), [1.0, 1.5, -4.0, 0.5, 1.45], rtol=0, atol=1e-6)


def test_repeat_penalty_with_no_window_penalizes_nothing():
    sampler = Sampler(SamplingParams(temperature=0.0, repeat_penalty=2.0, repeat_last_n=0), prompt_ids=[1])
    np.testing.assert_array_equal(sampler.adjust(LOGITS), LOGITS)


def test_logprob_shape_and_normalization():
    lp = token_logprob(LOGITS, 1, 3, lambda i: f"t{i}", lambda i: f"t{i}".encode())
    assert lp.token == "t1" and lp.bytes == list(b"t1")
    assert [t.token for t in lp.top] == ["t1", "t4", "t2"]
    expected = np.log(softmax(LOGITS))
    assert abs(lp.logprob - expected[1]) < 1e-6
    assert [t.logprob for t in lp.top] == pytest.approx([expected[1], expected[4], expected[2]], abs=1e-6)


@pytest.mark.parametrize("size", [10, 300, 49_152])
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999, 0.9999999])
def test_the_nucleus_is_what_a_full_sort_gives(size: int, top_p: float) -> None:
    """Ordering only the largest weights gives the fewest tokens reaching top_p, in a stable
    full sort's order, ties included (weights rounded to few values, flat and peaked ones)."""
    rng = np.random.default_rng(size)
    for weights in (np.round(rng.random(size), 1) + 1e-3, np.exp(rng.standard_normal(size) * 4),
                    np.ones(size), np.exp(-np.arange(size, dtype=np.float64))):
        order = np.argsort(-weights, kind="stable")
        end = int(np.searchsorted(np.cumsum(weights[order]), top_p * weights.sum())) + 1
        assert np.array_equal(_nucleus(weights, top_p), order[:min(end, size)])
