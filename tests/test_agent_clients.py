"""Claude Code and Codex CLI, the real clients, in real multi-turn tool sessions against a server.

A tiny random-weight model would never choose to call a tool, so the round trips run on a scripted
model (tests/engine_proxies.py `ScriptedEngine`: the real NumPy engine, template, tokenizer, reply
router, tool parsing, dialects and KV slots, with the logits masked to spell the script's reply):
Claude Code on the Qwen3.5 fixture (a hybrid model), Codex on the Qwen3-Coder-shaped qwen3moe one.
The smoke runs at the end are unscripted: SmolLM2 says whatever it says, and the clients must take
it without a protocol error.

The clients come from scripts/install_agents.sh (.ci/run runs it); absent, the tests skip.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.agent_clients import (
    HYBRID_MODEL,
    SCRIPTED_CTX,
    SCRIPTED_MODEL,
    access_entries,
    codex_events,
    qwen3_coder_call,
    read_chain,
    recorded,
    run_claude,
    run_codex,
)
from tests.engine_proxies import Rule, Script
from tests.hooked_server import Hooks
from tests.server_util import Server, start_server

# Each client session prefills its 40,000-token (Claude Code) or 9,000-token (Codex) prompt: on an
# AVX2 box (no int8 kernels) one Claude Code test took 266 s alone and over 300 with another worker beside it.
pytestmark = [pytest.mark.xdist_group("smollm2_long_context"), pytest.mark.timeout(900)]

CLAUDE_ANSWER = "The note names the next marker, as asked."
CODEX_SECRET = "HERON-2290"
CODEX_ANSWER = f"The codeword in notes.txt is {CODEX_SECRET}."


class Scripted:
    """The scripted server and the folders its script points into. `thought`: the model thinks
    first (Qwen3.5, whose generation prompt opens `<think>`): every reply closes its thinking."""

    def __init__(self, root: Path, thought: str = "") -> None:
        self.claude_dir, self.codex_dir = root / "claude-work", root / "codex-work"
        self.claude_dir.mkdir()
        self.codex_dir.mkdir()
        (self.codex_dir / "notes.txt").write_text(f"Codeword {CODEX_SECRET}.\n")
        claude_rules, self.claude_marker = read_chain(self.claude_dir, "READ-THE-NOTES", 1, CLAUDE_ANSWER)
        rules = (*claude_rules, Rule("CAT-THE-NOTES", qwen3_coder_call("exec_command", cmd="cat notes.txt")),
                 Rule(CODEX_SECRET, CODEX_ANSWER))
        self.script = Script(tuple(Rule(r.after, thought + r.reply) for r in rules))
        self.script_path, self.record = root / "script.json", root / "requests.jsonl"
        self.script.dump(self.script_path)
        self.server: Server | None = None


@contextmanager
def scripted_server(root: Path, model: Path, thought: str = "") -> Iterator[Scripted]:
    setup = Scripted(root, thought)
    hooks = Hooks(script=setup.script_path, record=setup.record)
    with start_server(str(model), "--engine", "cpu", "--ctx", SCRIPTED_CTX, hooks=hooks) as server:
        setup.server = server
        yield setup


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory):
    with scripted_server(tmp_path_factory.mktemp("agents"), SCRIPTED_MODEL) as setup:
        yield setup


def assert_mostly_cached(entry: dict) -> None:
    """The follow-up turn reused the KV of the first: at least 90% of its prompt was cached."""
    assert entry["cached_tokens"] >= 0.9 * entry["prompt_tokens"], entry


def claude_code_round_trip(scripted: Scripted, home: Path, **models: str) -> None:
    """One `claude -p` session: a Read call, then the answer from what it read."""
    run = run_claude(scripted.server, "READ-THE-NOTES: what does note1.txt say?", scripted.claude_dir, home,
                     "--output-format", "json", **models)
    assert run.returncode == 0, run.stderr + run.stdout
    assert json.loads(run.stdout)["result"] == CLAUDE_ANSWER
    first, second = recorded(scripted.record, "/v1/messages")[-2:]
    assert "Read" in [tool["name"] for tool in first["tools"]]  # its default tools were offered
    results = [block for block in second["messages"][-1]["content"] if block["type"] == "tool_result"]
    assert len(results) == 1 and scripted.claude_marker in str(results[0]["content"])
    cold, warm = access_entries(scripted.server, "/messages")[-2:]
    assert cold["status"] == warm["status"] == 200 and cold["prompt_tokens"] > 40_000
    assert cold["ttft_ms"] is not None  # a reply that is only a tool call still has a first output
    assert_mostly_cached(warm)


def test_codex_runs_a_shell_command_and_answers(scripted: Scripted, tmp_path: Path):
    run = run_codex(scripted.server, "CAT-THE-NOTES and tell me the codeword.", scripted.codex_dir,
                    tmp_path / "home", "--json")
    assert run.returncode == 0, run.stderr + run.stdout
    items = [event["item"] for event in codex_events(run) if event["type"] == "item.completed"]
    commands = [item for item in items if item["type"] == "command_execution"]
    assert len(commands) == 1 and "cat notes.txt" in commands[0]["command"] and commands[0]["exit_code"] == 0
    assert [item["text"] for item in items if item["type"] == "agent_message"] == [CODEX_ANSWER]
    first, second = recorded(scripted.record, "/v1/responses")[-2:]
    assert "exec_command" in [tool.get("name") for tool in first["tools"]]
    assert "max_output_tokens" not in first  # Codex sets no budget: the reply may run to the context's end
    outputs = [item for item in second["input"] if item.get("type") == "function_call_output"]
    assert len(outputs) == 1 and CODEX_SECRET in str(outputs[0]["output"])
    cold, warm = access_entries(scripted.server, "/responses")[-2:]
    assert cold["status"] == warm["status"] == 200
    assert_mostly_cached(warm)


def test_temp_sets_the_temperature_of_requests_that_send_none(smollm2_long_context: Server):
    def reply(**sampling) -> str:
        r = httpx.post(smollm2_long_context.base_url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "Write one sentence about the sea."}],
            "max_tokens": 16, **sampling})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    greedy = reply(temperature=0)
    assert reply(seed=1) == reply(seed=2) == greedy
    assert "defaults temperature 0 (greedy: the embedded demo model answers best so; temperature from --temp)" \
        in smollm2_long_context.log()


QUESTION = "What is the capital of France?"  # one SmolLM2 answers in a sentence, then ends its turn
PROTOCOL_TROUBLE = ("API Error", "stream disconnected", "unexpected", "Incomplete response", "invalid")


def test_claude_code_unscripted_on_smollm2(smollm2_long_context: Server, tmp_path: Path):
    (tmp_path / "work").mkdir()
    run = run_claude(smollm2_long_context, QUESTION, tmp_path / "work", tmp_path / "home",
                     "--tools", "")
    assert run.returncode == 0, run.stderr + run.stdout
    assert run.stdout.strip()
    assert not [word for word in PROTOCOL_TROUBLE if word in run.stderr + run.stdout], run.stderr


def test_codex_unscripted_on_smollm2(smollm2_long_context: Server, tmp_path: Path):
    (tmp_path / "work").mkdir()
    run = run_codex(smollm2_long_context, QUESTION, tmp_path / "work", tmp_path / "home", "--json")
    assert run.returncode == 0, run.stderr + run.stdout
    events = codex_events(run)
    assert [e for e in events if e["type"] == "turn.completed"]
    assert not [e for e in events if e["type"] in ("error", "turn.failed")], run.stdout
    assert not [word for word in PROTOCOL_TROUBLE if word in run.stderr], run.stderr


def test_claude_code_reads_a_file_in_sessions_on_two_models_of_one_server(tmp_path: Path):
    """Claude Code on Qwen3.5 (the model people pair with it now; Gated DeltaNet layers, whose state
    cannot be cut back), set up as users do with two models: its main model (ANTHROPIC_MODEL, also
    Sonnet's and Opus's name) the startup model, its small fast one (ANTHROPIC_DEFAULT_HAIKU_MODEL)
    another of --models-dir; then a session whose main model is that other one. Each session is a
    Read round trip whose follow-up turn is still >= 90% from cache, resumed at the checkpoint where
    the first turn's history ended. Every request is served by the model it named (the access log's
    `model`), on one server. (In `-p` mode this version sends its requests to the main model only.)
    The template thinks (the generation prompt opens `<think>`), so every scripted reply closes its
    thinking first."""
    (tmp_path / "agents").mkdir()
    models = tmp_path / "models"
    models.mkdir()
    shutil.copy(HYBRID_MODEL, models / "small.gguf")  # a file of its own: a second resident model
    setup = Scripted(tmp_path / "agents", thought="I will read the note.\n</think>\n\n")
    hooks = Hooks(script=setup.script_path, record=setup.record)
    with start_server(str(HYBRID_MODEL), "--engine", "cpu", "--ctx", SCRIPTED_CTX, "--models-dir", str(models),
                      hooks=hooks) as server:
        setup.server = server
        main = httpx.get(server.base_url + "/v1/models").json()["data"][0]["id"]
        for main_model in (main, "small"):
            claude_code_round_trip(setup, tmp_path / f"home-{main_model}", main_model=main_model,
                                   small_model="small")
        sent = [body["model"] for body in recorded(setup.record, "/v1/messages")]
        assert main in sent and "small" in sent and set(sent) == {main, "small"}
        served = [entry["model"] for entry in access_entries(server, "/messages")]
        assert served == sent  # in order: each request answered by the model it asked for
        loaded = {m["id"] for m in httpx.get(server.base_url + "/models/status").json()["models"]}
        assert loaded == {main, "small"}
