"""KV reuse as clients see it: cached tokens in every dialect, warm conversations, restarts."""

from __future__ import annotations

import httpx
import pytest

from tests.hooked_server import Hooks
from tests.server_util import start_server

SYSTEM = "You are a terse assistant for a hardware store. " * 25  # a long shared system prompt
GREEDY = {"temperature": 0, "max_tokens": 12}


def chat(server, messages: list[dict], **extra) -> dict:
    r = httpx.post(server.base_url + "/v1/chat/completions", json={"messages": messages, **GREEDY, **extra},
                   timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def fed(reply: dict) -> int:
    """Prompt plus reply tokens that went through the KV cache. A reply cut by max_tokens ends on a
    token that was sampled but never fed back (there was no next step), so it is one short."""
    usage = reply["usage"]
    cut = reply["choices"][0]["finish_reason"] == "length"
    return usage["prompt_tokens"] + usage["completion_tokens"] - cut


def turn(server, history: list[dict], text: str) -> tuple[list[dict], dict]:
    messages = history + [{"role": "user", "content": text}]
    data = chat(server, messages)
    return messages + [data["choices"][0]["message"]], data


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with start_server("--engine", "cpu", "--ctx", "2048", "--kv-slots", "3") as s:
        yield s


def test_follow_up_turn_and_shared_system_prompt_stay_warm(server):
    a, a1 = turn(server, [{"role": "system", "content": SYSTEM}], "Do you sell hammers?")
    b, b1 = turn(server, [{"role": "system", "content": SYSTEM}], "What time do you open?")
    # B shares only the system prompt with A: copied from A's slot, A's slot left intact.
    assert b1["usage"]["prompt_tokens_details"]["cached_tokens"] >= 250
    _, a2 = turn(server, a, "How much are they?")
    _, b2 = turn(server, b, "And close?")
    for first, second in ((a1, a2), (b1, b2)):
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= fed(first)


def test_cached_tokens_in_responses_and_anthropic(server):
    messages = [{"role": "user", "content": "Name a color."}]
    chat(server, messages)
    r = httpx.post(server.base_url + "/v1/responses", timeout=300,
                   json={"input": "Name a color.", "temperature": 0, "max_output_tokens": 8})
    usage = r.json()["usage"]
    assert usage["input_tokens_details"]["cached_tokens"] == usage["input_tokens"] - 1
    r = httpx.post(server.base_url + "/v1/messages", timeout=300,
                   json={"messages": messages, "max_tokens": 8, "temperature": 0})
    usage = r.json()["usage"]
    # Anthropic counts only the uncached part as input_tokens.
    assert usage["cache_read_input_tokens"] > 0 and usage["input_tokens"] == 1
    health = httpx.get(server.base_url + "/health").json()
    assert health["kv"]["in_use"] == 0 and health["kv"]["kv_bytes"] > 0


def test_spill_restart_restore_gives_the_same_reply(tmp_path):
    first = [{"role": "user", "content": "List three fruits."}]
    args = ("--engine", "cpu", "--ctx", "1024", "--kv-slots", "1", "--kv-cache-dir", str(tmp_path))
    with start_server(*args) as s:
        history, reply = turn(s, [], "List three fruits.")
        follow = history + [{"role": "user", "content": "Which is sweetest?"}]
        warm = chat(s, follow)["choices"][0]["message"]["content"]
        chat(s, [{"role": "system", "content": "Unrelated."}, {"role": "user", "content": "Hi"}])
    assert list(tmp_path.glob("*.lmkv"))
    with start_server(*args) as s:
        restored = chat(s, follow)
    assert restored["choices"][0]["message"]["content"] == warm
    assert restored["usage"]["prompt_tokens_details"]["cached_tokens"] >= fed(reply)
    assert first[0]["content"] in history[0]["content"]


def test_ram_guard_clamps_slots_and_force_keeps_them():
    hooks = Hooks(available_memory=600 * 1024 * 1024)  # 600 MiB: the weights (513 MiB) fit, 4 slots of 8k do not
    with start_server("--engine", "cpu", "--kv-slots", "4", "--ctx", "8192", hooks=hooks) as s:
        log = s.log()
        assert httpx.get(s.base_url + "/health").json()["kv"]["slots"] == 1
    assert "clamped from 4 by the RAM guard" in log
    assert "4 KV slots x 360 MiB (8192 tokens x 46080 bytes) = 1440 MiB, with 600 MiB" in log
    with start_server("--engine", "cpu", "--kv-slots", "4", "--ctx", "8192", "--kv-slots-force", hooks=hooks) as s:
        assert httpx.get(s.base_url + "/health").json()["kv"]["slots"] == 4
        assert "kv-slots-force" in s.log()


def test_default_context_is_what_one_kv_slot_fits_in_memory():
    """The trained context (8192) when a full slot of it fits; else the largest multiple of 4096."""
    with start_server("--engine", "cpu") as s:
        assert httpx.get(s.base_url + "/health").json()["context"] == 8192
        assert "8192 tokens (the model's trained context" in s.log()
    hooks = Hooks(available_memory=600 * 1024 * 1024)  # half of it, 300 MiB, holds 6,826 tokens of KV
    with start_server("--engine", "cpu", hooks=hooks) as s:
        assert httpx.get(s.base_url + "/v1/models").json()["data"][0]["context_window"] == 4096
        assert "4096 tokens (the largest multiple of 4096" in s.log()


def test_unwritable_kv_cache_dir_refuses_to_start(tmp_path):
    target = tmp_path / "file-not-dir"
    target.write_text("x")
    with pytest.raises(RuntimeError) as info, start_server("--engine", "cpu", "--kv-cache-dir", str(target)):
        pass
    assert f"--kv-cache-dir {target}: exists and is not a directory" in str(info.value)  # before loading
