"""Claude Code and Codex CLI run for real against a test server: where `scripts/install_agents.sh`
put them, each in a throwaway home so that nothing of the developer's own set-up leaks in.

Used by tests/test_agent_clients.py and scripts/bench_agent.py.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.engine_proxies import Rule
from tests.server_util import Server

REPO = Path(__file__).resolve().parents[1]
AGENT_BIN = REPO / ".agents" / "node_modules" / ".bin"
REQUIRED = "LMSERVE_REQUIRE_AGENTS"  # set by .ci/run: there, a missing client fails instead of skipping
# A tiny fixture with the Qwen3-Coder template: its 512-token vocabulary makes Claude Code's first
# request about 52,000 tokens, Codex's about 26,000.
SCRIPTED_MODEL = REPO / "tests" / "data" / "fixtures" / "arch" / "qwen3moe" / "tiny-qwen3moe-Q8_0.gguf"
HYBRID_MODEL = REPO / "tests" / "data" / "fixtures" / "arch" / "qwen35" / "tiny-qwen35-Q8_0.gguf"
SCRIPTED_CTX = "65536"


def agent_binary(name: str) -> Path:
    """The installed client, or a skip (a failure under .ci/run) saying how to install it."""
    path = AGENT_BIN / name
    if not path.exists():
        reason = f"{name} is not installed in {AGENT_BIN}: run scripts/install_agents.sh"
        if os.environ.get(REQUIRED):
            pytest.fail(reason)
        pytest.skip(reason)
    return path


def qwen3_coder_call(name: str, **params: str) -> str:
    """A tool call as the Qwen3-Coder template's model writes it."""
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


@dataclass(frozen=True)
class Run:
    returncode: int
    stdout: str
    stderr: str


def _run(argv: list[str], env: dict[str, str], cwd: Path, timeout: float) -> Run:
    proc = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    return Run(proc.returncode, proc.stdout, proc.stderr)


def _base_env(home: Path) -> dict[str, str]:
    home.mkdir(parents=True, exist_ok=True)
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8",
            "TERM": "dumb", "NO_COLOR": "1"}


def served_model(server: Server) -> str:
    """The startup model's id, as a user reads it from GET /v1/models to configure a client."""
    return httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"][0]["id"]


def run_claude(server: Server, prompt: str, cwd: Path, home: Path, *args: str, timeout: float = 600,
               main_model: str | None = None, small_model: str | None = None) -> Run:
    """`claude -p PROMPT ARGS` with the server as its Anthropic endpoint; its main model (Sonnet,
    Opus) and its small fast one (Haiku: titles, summaries) are the served model unless named."""
    main = main_model or served_model(server)
    small = small_model or main
    env = {**_base_env(home), "ANTHROPIC_BASE_URL": server.base_url, "ANTHROPIC_API_KEY": "local",
           "ANTHROPIC_MODEL": main, "ANTHROPIC_DEFAULT_HAIKU_MODEL": small,
           "ANTHROPIC_DEFAULT_SONNET_MODEL": main, "ANTHROPIC_DEFAULT_OPUS_MODEL": main,
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1"}
    return _run([str(agent_binary("claude")), "-p", prompt, *args], env, cwd, timeout)


def run_codex(server: Server, prompt: str, cwd: Path, home: Path, *args: str, timeout: float = 600) -> Run:
    """`codex exec ARGS PROMPT` with a provider that points at the server's /v1 (Responses API)."""
    env = {**_base_env(home), "CODEX_HOME": str(home / "codex"), "LMSERVE_KEY": "local"}
    (home / "codex").mkdir(exist_ok=True)
    (home / "codex" / "config.toml").write_text(
        f'model = "{served_model(server)}"\nmodel_provider = "lmserve"\n\n[model_providers.lmserve]\nname = "lmserve"\n'
        f'base_url = "{server.base_url}/v1"\nwire_api = "responses"\nenv_key = "LMSERVE_KEY"\n')
    # No sandbox: Codex's own (Landlock, seccomp) is not available in every container CI runs in.
    argv = [str(agent_binary("codex")), "exec", "--skip-git-repo-check", "-s", "danger-full-access", *args, prompt]
    return _run(argv, env, cwd, timeout)


def codex_events(run: Run) -> list[dict]:
    """The JSON lines `codex exec --json` printed."""
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]


def recorded(path: Path, route: str) -> list[dict]:
    """The bodies of the requests to `route` that tests/hooked_server.py recorded, in order."""
    if not path.exists():
        return []
    entries = [json.loads(line) for line in path.read_text().splitlines() if line]
    return [e["body"] for e in entries if e["method"] == "POST" and e["path"] == route]


def access_entries(server: Server, route: str) -> list[dict]:
    """The server's access-log lines for `route` ("/messages", "/responses"), in order."""
    out = []
    for line in server.log().splitlines():
        if "lmserve.access: " in line:
            entry = json.loads(line.split("lmserve.access: ", 1)[1])
            if entry["route"] == route and entry["method"] == "POST":
                out.append(entry)
    return out


def read_chain(workdir: Path, start: str, turns: int, answer: str) -> tuple[list[Rule], str]:
    """Files that lead Claude Code through `turns` Read calls, and the script that does it: the
    prompt holds `start`, each file names the next marker, the last file's marker gets `answer`.
    Returns the rules and the last file's marker."""
    rules, marker = [], start
    for turn in range(1, turns + 1):
        path = workdir / f"note{turn}.txt"
        rules.append(Rule(marker, qwen3_coder_call("Read", file_path=str(path))))
        marker = f"MARK{turn}-{'QWXZ'[turn % 4]}{turn * 7919}"  # never contains `start`
        path.write_text(f"Note {turn}: the next marker is {marker}.\n")
    rules.append(Rule(marker, answer))
    return rules, marker
