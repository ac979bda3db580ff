"""Legacy /v1/completions through the openai SDK, checked against OpenAI's own schema."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.openai_spec import validate

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(smollm2_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=smollm2_server.base_url + "/v1", api_key="local", max_retries=0)


def test_text_prompt_token_prompt_and_several_prompts(client, smollm2_server):
    done = client.completions.create(model="gpt-4o-mini", prompt=PROMPT, max_tokens=6, temperature=0)
    validate("CreateCompletionResponse", done.model_dump(mode="json", exclude_unset=True))
    text = done.choices[0].text
    assert text.strip() and done.choices[0].finish_reason in ("stop", "length")
    ids = httpx.post(smollm2_server.base_url + "/tokenize", json={"content": PROMPT}).json()["tokens"]
    by_ids = client.completions.create(model="gpt-4o-mini", prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == text and by_ids.usage.prompt_tokens == len(ids)
    several = client.completions.create(model="gpt-4o-mini", prompt=[PROMPT, "One, two, three,"], max_tokens=6,
                                        temperature=0)
    assert [c.index for c in several.choices] == [0, 1]
    assert several.choices[0].text == text
    counting = httpx.post(smollm2_server.base_url + "/tokenize", json={"content": "One, two, three,"})
    assert several.usage.prompt_tokens == len(ids) + len(counting.json()["tokens"])


def test_stream_matches_non_stream_and_logprobs(client):
    whole = client.completions.create(model="gpt-4o-mini", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2)
    chunks = list(client.completions.create(model="gpt-4o-mini", prompt=PROMPT, max_tokens=8, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    lp = whole.choices[0].logprobs
    assert "".join(lp.tokens) == whole.choices[0].text
    assert all(len(top) == 2 for top in lp.top_logprobs) and lp.text_offset[0] == 0


@pytest.mark.parametrize(("extra", "param"), [({"suffix": "x"}, "suffix"), ({"echo": True}, "echo"),
                                              ({"n": 3}, "n"), ({"prompt": [[999999]]}, "prompt[0]")])
def test_rejected_fields_name_themselves(smollm2_server, extra, param):
    r = httpx.post(smollm2_server.base_url + "/v1/completions", json={"prompt": PROMPT, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_the_server_reply_budget_applies_where_the_request_sets_none() -> None:
    """--max-tokens is the budget of a completion that sets none (before the API's own 16)."""
    from lmserve.model.default_model import default_model_path
    from tests.server_util import start_server

    with start_server(str(default_model_path()), "--ctx", "512", "--max-tokens", "24") as server:
        r = httpx.post(server.base_url + "/v1/completions", timeout=120,
                       json={"prompt": "1, 2, 3, 4, 5, 6,", "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 24 and r.json()["choices"][0]["finish_reason"] == "length"
