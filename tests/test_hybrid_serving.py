"""A hybrid model (Qwen3.5: Gated DeltaNet layers beside full attention) served as clients see it:
follow-up turns served from cache although a recurrent state cannot be cut back, replies the same
as a server that reuses nothing, after a restart from the disk tier, and with speculative decoding.

The tiny qwen35 fixture has random weights: its words are noise, but deterministic noise, so any
state restored wrongly (a checkpoint at the wrong position, a rollback that leaves a rejected draft
in the recurrent state) changes the greedy reply.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest

from tests.families import Fixture
from tests.hooked_server import Hooks
from tests.server_util import Server, start_server

MODEL = str(Fixture("qwen35", "Q8_0").path)
ARGS = ("--engine", "cpu", "--ctx", "4096")
SYSTEM = "You are a careful coding assistant working in a large repository. " * 12
QUESTIONS = ["Where is the parser?", "Open it.", "Now fix the bug on line 3.", "Run the tests."]


def chat(server: Server, messages: list[dict], **extra) -> dict:
    body = {"messages": messages, "temperature": 0, "max_tokens": 10, **extra}
    r = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def session(server: Server, turns: int) -> Iterator[tuple[list[dict], dict]]:
    """Each turn's request messages and the reply: the model thinks (Qwen3.5's default), and its
    answer goes back into the history as a client would send it."""
    history = [{"role": "system", "content": SYSTEM}]
    for question in QUESTIONS[:turns]:
        history.append({"role": "user", "content": question})
        reply = chat(server, history)
        yield list(history), reply
        history.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"] or ""})


def said(reply: dict) -> tuple[str, str]:
    message = reply["choices"][0]["message"]
    return message.get("reasoning_content") or "", message["content"] or ""


def cached(reply: dict) -> float:
    usage = reply["usage"]
    return usage["prompt_tokens_details"]["cached_tokens"] / usage["prompt_tokens"]


@pytest.fixture(scope="module")
def cold() -> Iterator[Server]:
    with start_server(MODEL, *ARGS, "--no-kv-reuse") as server:
        yield server


def test_follow_up_turns_are_served_from_cache_with_the_replies_of_no_reuse(cold: Server) -> None:
    with start_server(MODEL, *ARGS) as warm:
        turns = list(session(warm, 4))
    for i, (messages, reply) in enumerate(turns):
        assert said(reply) == said(chat(cold, messages)), f"turn {i + 1} differs from a cold prefill"
        if i:
            assert cached(reply) >= 0.9, f"turn {i + 1}: {reply['usage']}"
    assert any(said(reply)[0] for _, reply in turns)  # it did think: the reply opened inside <think>


def test_a_restart_resumes_the_session_from_the_disk_tier(cold: Server, tmp_path) -> None:
    args = (MODEL, *ARGS, "--kv-slots", "1", "--kv-cache-dir", str(tmp_path))
    with start_server(*args) as server:
        (_, _), (second, reply) = session(server, 2)
        chat(server, [{"role": "user", "content": "Something else entirely."}])  # spills the session
    assert list(tmp_path.glob("*.lmkv"))
    follow = [*second, {"role": "assistant", "content": said(reply)[1]}, {"role": "user", "content": QUESTIONS[2]}]
    with start_server(*args) as server:
        restored = chat(server, follow)
    assert cached(restored) >= 0.9, restored["usage"]
    assert said(restored) == said(chat(cold, follow))


def test_a_retry_of_the_same_prompt_reuses_all_but_its_last_token() -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
    with start_server(MODEL, *ARGS) as server:
        first, again = chat(server, messages), chat(server, messages)
    assert said(first) == said(again)
    usage = again["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1


COPY = ("def parse(line):\n    key, value = line.split('=')\n    return key.strip(), value.strip()\n\n"
        "def load(path):\n    with open(path) as f:\n        return dict(parse(l) for l in f if l.strip())\n")


def drafts(server: Server) -> tuple[int, int]:
    """Drafted and accepted tokens so far (/metrics)."""
    metrics = httpx.get(server.base_url + "/metrics", timeout=30).text
    return tuple(int(float(re.search(rf"^{name} (\S+)$", metrics, re.M).group(1)))
                 for name in ("lmserve_draft_tokens_total", "lmserve_draft_accepted_tokens_total"))


PINNED = Hooks(drafts_always_pay=True)  # which drafts are verified does not depend on pass timings
SPECULATION = {"ngram": ("--speculate", "ngram"),  # prompt lookup
               "draft": ("--draft", str(Fixture("qwen35", "Q4_K_M").path)),  # a hybrid draft model too
               "off": ("--speculate", "off")}


@pytest.mark.parametrize("engine", ["cpu", "mlx"])
def test_speculative_decoding_leaves_replies_and_the_cache_as_plain_decoding(engine: str) -> None:
    """A copy-heavy prompt, drafted by prompt lookup and by a draft model (the Q4_K_M file, itself
    hybrid, rewinding its own cache past rejected drafts); some drafts are rejected, and each
    rejection rolls the recurrent state back by recomputing the kept tokens. The reply, and the
    next turn that continues the same slot, are what plain decoding gives."""
    first = [{"role": "user", "content": "Repeat this:\n" + COPY}]
    replies = {}
    for mode, flags in SPECULATION.items():
        with start_server(MODEL, "--engine", engine, "--ctx", "2048", *flags, hooks=PINNED) as server:
            one = chat(server, first, max_tokens=80, reasoning_effort="none")
            follow = [*first, {"role": "assistant", "content": said(one)[1]}, {"role": "user", "content": "Again."}]
            two = chat(server, follow, max_tokens=40, reasoning_effort="none")
            replies[mode] = (said(one), said(two), drafts(server))
    for mode in ("ngram", "draft"):
        drafted, accepted = replies[mode][2]
        assert 0 < accepted < drafted, (mode, replies[mode][2])  # taken and rejected drafts: rollbacks ran
        assert replies[mode][:2] == replies["off"][:2], mode
    assert replies["off"][2] == (0, 0)
