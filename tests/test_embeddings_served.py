"""`/v1/embeddings` on a real server through the OpenAI SDK (issue 31): the tiny Qwen3 embedding
fixture's vectors equal transformers' and llama-server's on the same file; strings, token ids and
batches; base64; dimensions; errors naming the field; a generative model pooled at its last token."""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import openai
import pytest

from tests.conftest import DATA
from tests.server_util import start_server

FIXTURE = DATA / "fixtures" / "embedding"
REFERENCES = json.loads((FIXTURE / "references.json").read_text())
F16 = FIXTURE / "tiny-qwen3-embedding-F16.gguf"


@pytest.fixture(scope="module")
def server():
    with start_server(str(F16), "--engine", "cpu", "--ctx", "256") as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="local", max_retries=0)


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_vectors_equal_transformers_and_llama_server(client: openai.OpenAI) -> None:
    """All four reference inputs in one batched request, as token ids."""
    result = client.embeddings.create(model="tiny-qwen3-embedding-F16", input=REFERENCES["token_ids"])
    assert [d.index for d in result.data] == [0, 1, 2, 3]
    llama = REFERENCES["llama_server"][F16.name]["embeddings"]
    for got, want, peer in zip(result.data, REFERENCES["transformers"], llama, strict=True):
        assert len(got.embedding) == 64 and abs(np.linalg.norm(got.embedding) - 1) < 1e-5
        assert cosine(got.embedding, want) >= 0.9999 and cosine(got.embedding, peer) >= 0.9999
    tokens = sum(len(ids) for ids in REFERENCES["token_ids"])
    assert result.usage.prompt_tokens == result.usage.total_tokens == tokens
    assert result.model == "tiny-qwen3-embedding-F16"


def test_a_string_is_its_tokens(client: openai.OpenAI, server) -> None:
    text = "The quick brown fox"
    ids = httpx.post(server.base_url + "/tokenize", json={"content": text, "add_special": True}).json()["tokens"]
    by_text = client.embeddings.create(model="text-embedding-3-small", input=text)
    by_ids = client.embeddings.create(model="text-embedding-3-small", input=ids)
    assert by_text.usage.prompt_tokens == len(ids)
    np.testing.assert_array_equal(by_text.data[0].embedding, by_ids.data[0].embedding)
    two = client.embeddings.create(model="text-embedding-3-small", input=[text, "something else"])
    np.testing.assert_array_equal(two.data[0].embedding, by_text.data[0].embedding)
    assert cosine(two.data[0].embedding, two.data[1].embedding) < 0.999


def test_base64_and_dimensions(server) -> None:
    url = server.base_url + "/v1/embeddings"
    ids = REFERENCES["token_ids"][2]
    plain = httpx.post(url, json={"input": ids}).json()["data"][0]["embedding"]
    packed = httpx.post(url, json={"input": ids, "encoding_format": "base64"}).json()["data"][0]["embedding"]
    np.testing.assert_array_equal(np.frombuffer(base64.b64decode(packed), "<f4"), np.float32(plain))
    short = httpx.post(url, json={"input": ids, "dimensions": 16}).json()["data"][0]["embedding"]
    head = np.asarray(plain[:16], np.float64)
    np.testing.assert_allclose(short, head / np.linalg.norm(head), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("body", "param"), [
    ({"input": []}, "input"),
    ({"input": [[1, 2], "text"]}, "input"),
    ({"input": [[1, 2], [10**9]]}, "input[1]"),
    ({"input": [[1, 2], []]}, "input[1]"),
    ({"input": "hi", "dimensions": 0}, "dimensions"),
    ({"input": "hi", "dimensions": 65}, "dimensions"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "hi", "model": "no-such-embedder"}, "model"),
])
def test_bad_input_is_a_400_naming_the_field(server, body: dict, param: str) -> None:
    r = httpx.post(server.base_url + "/v1/embeddings", json=body)
    assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text


def test_a_generative_model_embeds_with_its_last_token(smollm2_server) -> None:
    client = openai.OpenAI(base_url=smollm2_server.base_url + "/v1", api_key="local", max_retries=0)
    result = client.embeddings.create(model="text-embedding-3-small", input=["Paris is in France.", "Hello"])
    vectors = [d.embedding for d in result.data]
    assert all(len(v) == 576 and abs(np.linalg.norm(v) - 1) < 1e-5 for v in vectors)
    assert cosine(*vectors) < 0.999
