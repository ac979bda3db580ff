"""A request that leaves sampling to the server gets the model's own recommendation."""

from __future__ import annotations

import httpx

from lmserve.core.types import SamplingParams
from lmserve.model.families import recommended_sampling

QUESTION = [{"role": "user", "content": "Write one sentence about the sea."}]


def test_the_files_own_sampling_keys_win_over_the_family_table() -> None:
    md = {"general.name": "Qwen3 30B A3B", "general.sampling.temp": 0.3, "general.sampling.top_k": 7}
    rec = recommended_sampling("qwen3moe", md)
    assert rec.values() == {"temperature": 0.3, "top_k": 7} and "general.sampling" in rec.source
    assert recommended_sampling("qwen3moe", {"general.name": "Qwen3 30B A3B"}).values() == {
        "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0}
    assert recommended_sampling("qwen3moe", {"general.name": "Qwen3-Coder-30B-A3B"}).values()["temperature"] == 0.7
    assert recommended_sampling("llama", {"general.name": "SmolLM2 135M"}).values() == {
        "temperature": 0.2, "top_p": 0.9}
    assert recommended_sampling("phi3", {}).values() == {}  # no recommendation: the APIs' defaults


def test_only_the_fields_a_client_left_out_take_defaults() -> None:
    asked = SamplingParams(temperature=0.9, given=frozenset({"temperature"}))
    filled = asked.with_defaults({"temperature": 0.2, "top_p": 0.9})
    assert (filled.temperature, filled.top_p) == (0.9, 0.9)
    assert SamplingParams().with_defaults({"top_k": 20}).top_k == 20


def reply(server, **sampling) -> str:
    r = httpx.post(server.base_url + "/v1/chat/completions", timeout=120,
                   json={"messages": QUESTION, "max_tokens": 24, **sampling})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_the_embedded_demo_model_is_greedy_unless_asked(smollm2_server) -> None:
    """No model named: the embedded SmolLM2-135M samples greedily by default (sampled as its card
    says, 0.2 / 0.9, it answered the README's question wrongly 2 times in 5), so leaving sampling
    out equals temperature 0 whatever the seed; a request's own temperature still samples."""
    greedy = reply(smollm2_server, temperature=0)
    assert [reply(smollm2_server, seed=seed) for seed in (1, 2, 3)] == [greedy] * 3
    sampled = [reply(smollm2_server, seed=s, temperature=1.0, top_p=1.0) for s in (1, 2, 3)]
    assert sampled != [greedy] * 3
    assert "sampling       defaults temperature 0 (greedy: the embedded demo model answers best so)" \
        in smollm2_server.log()


def test_the_embedded_model_answers_the_readme_question_every_time(smollm2_server) -> None:
    """The README's first question, asked as its curls do (no sampling fields) and by fresh
    conversations ten times: Paris every time."""
    question = [{"role": "user", "content": "What is the capital of France?"}]
    answers = []
    for _ in range(10):
        r = httpx.post(smollm2_server.base_url + "/v1/messages", timeout=120,
                       json={"model": "gpt-4o-mini", "max_tokens": 24, "messages": question})
        assert r.status_code == 200, r.text
        answers.append(r.json()["content"][0]["text"])
    assert all("Paris" in a for a in answers), answers
