"""Faults while serving: a worker-side exception in one request, a disk-tier file damaged under a
running server, and models the server cannot read. (An unwritable --kv-cache-dir is refused in
tests/test_kv_serving.py; SIGTERM under load is in tests/test_soak.py.)"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading

import httpx
import pytest

from tests.hooked_server import Hooks
from tests.server_util import start_server
from tests.wire_check import PATHS, check_body, check_error, check_stream

MARKER = "FAULT-MARKER-7"
SIBLING = {"messages": [{"role": "user", "content": "Write a very long story about a dragon."}],
           "temperature": 0, "max_tokens": 64, "logit_bias": {"0": -100, "2": -100, "4": -100}, "stream": True,
           "stream_options": {"include_usage": True}}


def faulty(dialect: str, stream: bool) -> dict:
    text = f"{MARKER} Tell me about the sea."
    if dialect == "responses":
        return {"input": text, "max_output_tokens": 32, "stream": stream, "temperature": 0}
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 32, "stream": stream, "temperature": 0}


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=300)


def test_worker_fault_ends_that_request_in_band_and_others_keep_running():
    with start_server("--engine", "cpu", "--ctx", "1024", "--batch", "2", hooks=Hooks(fault_marker=MARKER)) as server:
        sibling: dict[str, str] = {}

        def run_sibling() -> None:
            with httpx.stream("POST", server.base_url + PATHS["chat"], json=SIBLING, timeout=300) as r:
                sibling["raw"] = r.read().decode()

        thread = threading.Thread(target=run_sibling)
        thread.start()
        for dialect in ("chat", "responses", "messages"):  # each fails at its third token, mid-stream
            r = post(server, PATHS[dialect], faulty(dialect, stream=True))
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
            reply = check_stream(dialect, r.text)
            assert reply.error is not None and "injected test fault" in reply.error, r.text
        r = post(server, PATHS["chat"], faulty("chat", stream=False))
        assert r.status_code == 500 and "injected test fault" in check_error(PATHS["chat"], 500, r.json())
        thread.join()
        reply = check_stream("chat", sibling["raw"])  # decoded alongside every failure, to the end
        assert reply.error is None and reply.finish == "length" and reply.completion_tokens == 64
        ok = post(server, PATHS["chat"], {"messages": [{"role": "user", "content": "What is the capital of France?"}],
                                          "temperature": 0, "max_tokens": 16})
        assert check_body("chat", ok.json()).text == "The capital of France is Paris."
        health = httpx.get(server.base_url + "/health").json()
        assert (health["queue_depth"], health["active_sequences"], health["kv"]["in_use"]) == (0, 0, 0)
        assert "InjectedFault" in server.log()


def chat(server, messages: list[dict]) -> dict:
    r = post(server, PATHS["chat"], {"messages": messages, "temperature": 0, "max_tokens": 12})
    assert r.status_code == 200, r.text
    return r.json()


def damage(path, how: str) -> None:
    if how == "removed":
        path.unlink()
        return
    data = bytearray(path.read_bytes())
    middle = len(data) * 3 // 4  # inside the payload, past the header
    data[middle:middle + 64] = os.urandom(64)
    path.write_bytes(bytes(data))


def test_disk_tier_file_removed_or_corrupted_while_serving_is_skipped(tmp_path):
    """A conversation spilled to disk, its file then damaged: the next turn is prefilled cold
    with the same greedy reply instead of being served from the damaged file."""
    args = ("--engine", "cpu", "--ctx", "1024", "--kv-slots", "1", "--kv-cache-dir", str(tmp_path))
    with start_server(*args) as server:
        for how in ("corrupted", "removed"):
            first = [{"role": "user", "content": f"List three {how} fruits."}]
            history = first + [chat(server, first)["choices"][0]["message"]]
            follow = history + [{"role": "user", "content": "Which is sweetest?"}]
            warm = chat(server, follow)
            before = set(tmp_path.glob("*.lmkv"))
            chat(server, [{"role": "user", "content": f"Unrelated {how} question: what is 2+2?"}])  # spills
            spilled = set(tmp_path.glob("*.lmkv")) - before
            assert len(spilled) == 1, spilled
            damage(spilled.pop(), how)
            again = chat(server, follow)
            assert again["choices"][0]["message"]["content"] == warm["choices"][0]["message"]["content"]
            # Only the template's shared opening can come from the resident slot, not the conversation.
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] < warm["usage"]["prompt_tokens"] // 2
        assert server.log().count("skipping unreadable KV cache file") >= 2


def _drop_file_override() -> None:
    """In the child: give up root's permission override (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH),
    so that mode 000 means unreadable even to root."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed")


@pytest.mark.parametrize("kind", ["directory", "fifo", "no read permission"])
def test_unreadable_model_refuses_to_start_with_one_clear_line(tmp_path, kind):
    model = tmp_path / "model.gguf"
    preexec = None
    if kind == "directory":
        model.mkdir()
    elif kind == "fifo":
        os.mkfifo(model)  # opening it to read would block forever: it must be refused before that
    else:
        model.write_bytes(b"GGUF" + bytes(64))
        model.chmod(0)
        if os.geteuid() == 0:
            if not sys.platform.startswith("linux"):
                pytest.skip("root reads mode-000 files; dropping the override needs Linux prctl")
            preexec = _drop_file_override
    try:
        result = subprocess.run([sys.executable, "-m", "lmserve.cli", str(model), "--port", "0"],
                                capture_output=True, text=True, timeout=60, preexec_fn=preexec)
    except subprocess.SubprocessError as exc:
        pytest.skip(f"cannot drop root's file-permission override here: {exc}")
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and len(lines) == 1 and lines[0].startswith("lmserve: "), result.stderr
    expected = {"directory": "is not a regular file", "fifo": "is not a regular file",
                "no read permission": "Permission denied"}[kind]
    assert expected in lines[0] and str(model) in lines[0]
