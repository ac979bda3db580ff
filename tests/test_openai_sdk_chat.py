"""Chat Completions through the official openai SDK."""

from __future__ import annotations

import math

import openai
import pytest

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(smollm2_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=smollm2_server.base_url + "/v1", api_key="local", max_retries=0)


def test_create(client):
    done = client.chat.completions.create(model="gpt-4o-mini", messages=CAPITAL, temperature=0)
    assert done.choices[0].message.content == "The capital of France is Paris."
    assert done.choices[0].finish_reason == "stop"
    assert done.usage.prompt_tokens == 37


def test_stream_true(client):
    chunks = list(client.chat.completions.create(model="gpt-4o-mini", messages=CAPITAL, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "The capital of France is Paris."
    assert chunks[-1].usage.completion_tokens == 7


def test_stream_helper_final_completion(client):
    with client.chat.completions.stream(model="gpt-4o-mini", messages=CAPITAL, temperature=0) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    assert final.choices[0].message.content == "The capital of France is Paris."


def test_logprobs_non_stream_and_stream(client):
    done = client.chat.completions.create(model="gpt-4o-mini", messages=CAPITAL, temperature=0, max_tokens=4,
                                          logprobs=True, top_logprobs=3)
    content = done.choices[0].logprobs.content
    assert [t.token for t in content] == ["The", " capital", " of", " France"]
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert t.top_logprobs[0].token == t.token  # greedy: the chosen token is the most likely
        assert bytes(t.bytes).decode() == t.token
    assert sum(math.exp(t.logprob) for t in content[0].top_logprobs) <= 1.0 + 1e-6
    chunks = list(client.chat.completions.create(model="gpt-4o-mini", messages=CAPITAL, temperature=0, max_tokens=4,
                                                 logprobs=True, top_logprobs=2, stream=True))
    streamed = [t.token for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content]
    assert streamed == ["The", " capital", " of", " France"]


def test_seeded_sampling_is_reproducible(client):
    kwargs = {"model": "gpt-4o-mini", "messages": CAPITAL, "temperature": 1.2, "max_tokens": 12, "seed": 1234}
    a = client.chat.completions.create(**kwargs).choices[0].message.content
    b = client.chat.completions.create(**kwargs).choices[0].message.content
    assert a == b


def test_n_greater_than_one_is_bad_request(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="gpt-4o-mini", messages=CAPITAL, n=2)
    assert info.value.body["param"] == "n"

