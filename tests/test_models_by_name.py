"""Models by the request's `model` (issue 30), on real servers: two fixture models served by one
process in every dialect, the same replies as a server of each alone; unknown names a 404 in the
dialect's envelope, hosted names the startup model; loading on first use, a request during a
load, eviction by --max-models and by the RAM guard (memory the test hooks report), --keep-alive,
config-file aliases with their own settings, and the admin routes."""

from __future__ import annotations

import concurrent.futures
import shutil
import time
from pathlib import Path

import httpx
import pytest

from lmserve.engine_cpu.engine import kernels_available
from lmserve.engine_cpu.weights import weight_bytes
from lmserve.model.config import ModelConfig
from lmserve.model.gguf_file import GGUFFile
from lmserve.pool.residents import LOAD_COST
from tests.families import ARCH
from tests.hooked_server import Hooks
from tests.server_util import start_server, wait_for

LLAMA = ARCH / "llama3" / "tiny-llama3-Q8_0.gguf"  # the startup model
QWEN = ARCH / "qwen2" / "tiny-qwen2-Q8_0.gguf"
PHI = ARCH / "phi3" / "tiny-phi3-Q8_0.gguf"
QUESTION = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("models")
    for path, name in ((QWEN, "qwen"), (PHI, "phi")):
        shutil.copy(path, folder / f"{name}.gguf")
    return folder


@pytest.fixture(scope="module")
def server(models_dir: Path):
    with start_server(str(LLAMA), "--ctx", "256", "--models-dir", str(models_dir)) as s:
        yield s


def chat(server, model: str | None, **extra) -> httpx.Response:
    body = {"messages": QUESTION, "max_tokens": 8, "temperature": 0, **extra}
    if model is not None:
        body["model"] = model
    return httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120)


def replies(base_url: str, model: str | None) -> list[str]:
    """One greedy reply per dialect (Chat Completions, Responses, Messages)."""
    named = {"model": model} if model else {}
    chat_reply = httpx.post(base_url + "/v1/chat/completions", timeout=120, json={
        **named, "messages": QUESTION, "max_tokens": 8, "temperature": 0}).json()["choices"][0]["message"]["content"]
    responses = httpx.post(base_url + "/v1/responses", timeout=120, json={
        **named, "input": QUESTION, "max_output_tokens": 8, "temperature": 0}).json()
    response_text = "".join(part["text"] for item in responses["output"] if item["type"] == "message"
                            for part in item["content"])
    message = httpx.post(base_url + "/v1/messages", timeout=120, json={
        "model": model or "claude-haiku-4-5", "messages": QUESTION, "max_tokens": 8, "temperature": 0}).json()
    return [chat_reply, response_text, "".join(b.get("text", "") for b in message["content"])]


def status(server) -> dict:
    return httpx.get(server.base_url + "/models/status", timeout=30).json()


def resident(server) -> set[str]:
    return {m["id"] for m in status(server)["models"]}


def test_two_models_alternate_in_every_dialect_as_each_alone(server) -> None:
    together = [replies(server.base_url, name) for name in (None, "qwen", None, "qwen")]
    with start_server(str(QWEN), "--ctx", "256") as alone:
        qwen_alone = replies(alone.base_url, None)
    with start_server(str(LLAMA), "--ctx", "256") as alone:
        llama_alone = replies(alone.base_url, None)
    assert together == [llama_alone, qwen_alone, llama_alone, qwen_alone]
    assert qwen_alone != llama_alone  # the two models do answer differently
    body = chat(server, "qwen").json()
    assert body["model"] == "qwen"


def test_the_model_list_says_which_are_loaded(server) -> None:
    chat(server, "qwen").raise_for_status()
    cards = {card["id"]: card for card in httpx.get(server.base_url + "/v1/models").json()["data"]}
    assert cards["tiny-llama3-Q8_0"]["loaded"] is True and cards["qwen"]["loaded"] is True
    assert cards["phi"]["loaded"] is False
    assert cards["phi"]["meta"]["architecture"] == "phi3" and cards["phi"]["context_window"] > 0
    assert httpx.get(server.base_url + "/v1/models/phi").json()["loaded"] is False
    missing = httpx.get(server.base_url + "/v1/models/no-such-model")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_an_unknown_name_is_a_404_in_the_dialects_envelope(server) -> None:
    r = chat(server, "qwen3:8b")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found" and r.json()["error"]["param"] == "model"
    assert "qwen3:8b" in r.json()["error"]["message"]
    r = httpx.post(server.base_url + "/v1/messages", json={"model": "qwen3:8b", "max_tokens": 4,
                                                            "messages": QUESTION})
    assert r.status_code == 404 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "not_found_error"
    r = chat(server, "/etc/hostname")  # a path is no model name: no request opens files
    assert r.status_code == 404


def test_hosted_names_and_none_are_the_startup_model(server) -> None:
    for name in (None, "gpt-4o-mini", "claude-sonnet-4-5", "tiny-llama3-Q8_0"):
        assert chat(server, name).json()["model"] == "tiny-llama3-Q8_0"


def test_concurrent_requests_during_a_load_share_it(models_dir: Path) -> None:
    """Three requests for a model not yet loaded and one for the startup model, at once: one load,
    every request answered (the startup model's without waiting for the load)."""
    with start_server(str(LLAMA), "--ctx", "256", "--models-dir", str(models_dir)) as s:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            named = [pool.submit(chat, s, "phi") for _ in range(3)]
            default = pool.submit(chat, s, None)
            assert default.result().status_code == 200
            assert [f.result().status_code for f in named] == [200] * 3
        assert status(s)["loads"] == 1


def test_max_models_unloads_the_least_recently_used_idle_one(models_dir: Path) -> None:
    with start_server(str(LLAMA), "--ctx", "256", "--models-dir", str(models_dir), "--max-models", "2") as s:
        chat(s, "qwen").raise_for_status()
        assert resident(s) == {"tiny-llama3-Q8_0", "qwen"}
        chat(s, "phi").raise_for_status()
        assert resident(s) == {"tiny-llama3-Q8_0", "phi"}  # the startup model stays
        assert chat(s, "qwen").status_code == 200  # loaded again on demand
        assert status(s)["loads"] == 3 and status(s)["unloads"] == 2


def test_the_ram_guard_unloads_an_idle_model_to_fit_another(models_dir: Path) -> None:
    """The hooks give the process the startup model's weights and room for one more model: loading
    a second model by name unloads the first, whose memory then comes back (its engine is gone:
    nothing of it is kept alive)."""
    room = weights(LLAMA) + int(1.6 * LOAD_COST * QWEN.stat().st_size)
    with start_server(str(LLAMA), "--ctx", "256", "--models-dir", str(models_dir), "--kv-slots", "1",
                      hooks=Hooks(memory_limit=room)) as s:
        chat(s, "qwen").raise_for_status()
        assert resident(s) == {"tiny-llama3-Q8_0", "qwen"}
        chat(s, "phi").raise_for_status()
        assert resident(s) == {"tiny-llama3-Q8_0", "phi"}
        chat(s, "qwen").raise_for_status()  # and back: phi's memory was given back in turn
        assert resident(s) == {"tiny-llama3-Q8_0", "qwen"}


def weights(path: Path) -> int:
    gguf = GGUFFile(path)
    return weight_bytes(gguf, ModelConfig.from_gguf(gguf), kernels_available())


def test_a_busy_model_is_not_unloaded(models_dir: Path) -> None:
    """With one model's room, a long reply of qwen holds it while phi is asked for: phi
    waits for qwen to finish, then loads; both answer."""
    with start_server(str(LLAMA), "--ctx", "256", "--models-dir", str(models_dir), "--max-models", "2") as s:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            long = pool.submit(chat, s, "qwen", max_tokens=200)
            wait_for(lambda: "qwen" in resident(s), timeout=60)
            other = pool.submit(chat, s, "phi")
            assert long.result().status_code == 200 and other.result().status_code == 200
        assert len(long.result().json()["choices"][0]["message"]["content"]) > 0


def test_keep_alive_unloads_idle_models_but_not_the_startup_one(models_dir: Path) -> None:
    with start_server(str(LLAMA), "--ctx", "256", "--models-dir", str(models_dir), "--keep-alive", "1s") as s:
        chat(s, "qwen").raise_for_status()
        assert "qwen" in resident(s)
        started = time.monotonic()
        wait_for(lambda: resident(s) == {"tiny-llama3-Q8_0"}, timeout=30)
        assert time.monotonic() - started >= 0.5


def test_aliases_of_the_config_file_bring_their_own_settings(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(f'[models.coder]\nmodel = "{QWEN}"\nctx = 128\ntemp = 0.0\n')
    with start_server(str(LLAMA), "--ctx", "256", "--config", str(config)) as s:
        r = chat(s, "coder")
        assert r.status_code == 200 and r.json()["model"] == "coder"
        card = httpx.get(s.base_url + "/v1/models/coder").json()
        assert card["loaded"] is True and card["context_window"] == 128
    config.write_text('[models.coder]\nmodel = "x.gguf"\nbatch = 3\n')
    with (pytest.raises(RuntimeError, match="unknown key 'batch' in \\[models.coder\\]"),
          start_server(str(LLAMA), "--config", str(config), timeout=30)):
        pass


def test_admin_routes_load_unload_and_report(models_dir: Path) -> None:
    with start_server(str(LLAMA), "--ctx", "256", "--models-dir", str(models_dir), "--api-key", "k") as s:
        key = {"Authorization": "Bearer k"}
        assert httpx.post(s.base_url + "/models/load", json={"model": "qwen"}).status_code == 401
        loaded = httpx.post(s.base_url + "/models/load", json={"model": "qwen"}, headers=key, timeout=120).json()
        assert loaded["loaded"] is True and loaded["weight_bytes"] > 0
        report = httpx.get(s.base_url + "/models/status", headers=key).json()["models"]
        assert {m["id"] for m in report} == {"tiny-llama3-Q8_0", "qwen"}
        health = httpx.get(s.base_url + "/health", headers=key).json()
        assert {m["id"] for m in health["models"]} == {"tiny-llama3-Q8_0", "qwen"}
        unloaded = httpx.post(s.base_url + "/models/unload", json={"model": "qwen"}, headers=key).json()
        assert unloaded["unloaded"] is True
        pinned = httpx.post(s.base_url + "/models/unload", json={"model": "tiny-llama3-Q8_0"}, headers=key)
        assert pinned.status_code == 409
        unknown = httpx.post(s.base_url + "/models/load", json={"model": "nope"}, headers=key)
        assert unknown.status_code == 404
