#!/usr/bin/env python3
"""What KV reuse buys an agent session: a scripted Claude Code run of N Read-tool turns, per-turn
TTFT and cached share, with prefix reuse and with `--no-kv-reuse`, measured in one run.

    .venv/bin/python scripts/bench_agent.py [--turns 4] [--tools Read]

The model is tests/engine_proxies.py's ScriptedEngine on a tiny Qwen3-Coder fixture (the real
engine, template, dialect and KV slots, its logits masked to spell each scripted tool call), so every
turn's prompt is Claude Code's real one: about 52,000 tokens with its default tools. Needs the
clients from scripts/install_agents.sh. Target: the last tool turn's TTFT with reuse <= 0.2x without.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.agent_clients import (  # noqa: E402
    AGENT_BIN,
    SCRIPTED_CTX,
    SCRIPTED_MODEL,
    access_entries,
    read_chain,
    run_claude,
)
from tests.engine_proxies import Script  # noqa: E402
from tests.hooked_server import Hooks  # noqa: E402
from tests.server_util import start_server  # noqa: E402

ANSWER = "I followed every note to the end."


def session(turns: int, reuse: bool, tools: str | None) -> list[dict]:
    """One scripted Claude Code session; the access-log entry of each of its model requests."""
    with tempfile.TemporaryDirectory(prefix="bench-agent-") as tmp:
        root = Path(tmp)
        work = root / "work"
        work.mkdir()
        rules, _ = read_chain(work, "FOLLOW-THE-NOTES", turns, ANSWER)
        Script(tuple(rules)).dump(root / "script.json")
        args = [str(SCRIPTED_MODEL), "--engine", "cpu", "--ctx", SCRIPTED_CTX, *([] if reuse else ["--no-kv-reuse"])]
        with start_server(*args, hooks=Hooks(script=root / "script.json"), timeout=300) as server:
            extra = ["--tools", tools] if tools is not None else []
            run = run_claude(server, "FOLLOW-THE-NOTES: read note1.txt, then each note it leads to.", work,
                             root / "home", "--output-format", "json", *extra, timeout=3600)
            if run.returncode != 0 or json.loads(run.stdout).get("result") != ANSWER:
                raise SystemExit(f"claude failed ({run.returncode}):\n{run.stdout}\n{run.stderr}")
            entries = access_entries(server, "/messages")
    if len(entries) != turns + 1:
        raise SystemExit(f"expected {turns + 1} model requests, saw {len(entries)}")
    return entries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=4, help="Read-tool turns before the answer (default 4)")
    parser.add_argument("--tools", default=None, help="Claude Code's --tools (default: all its tools)")
    args = parser.parse_args()
    if not (AGENT_BIN / "claude").exists():
        raise SystemExit("Claude Code is not installed: run scripts/install_agents.sh")
    warm = session(args.turns, True, args.tools)
    cold = session(args.turns, False, args.tools)
    print(f"{'turn':>4}  {'prompt':>7}  {'cached':>7}  {'TTFT reuse':>10}  {'TTFT none':>10}  {'ratio':>6}")
    for turn, (w, c) in enumerate(zip(warm, cold, strict=True), 1):
        kind = "tool" if turn <= args.turns else "answer"
        print(f"{turn:>4}  {w['prompt_tokens']:>7}  {w['cached_tokens'] / w['prompt_tokens']:>7.1%}  "
              f"{w['ttft_ms'] / 1000:>9.2f}s  {c['ttft_ms'] / 1000:>9.2f}s  {w['ttft_ms'] / c['ttft_ms']:>6.3f}  {kind}")
    ratio = warm[args.turns - 1]["ttft_ms"] / cold[args.turns - 1]["ttft_ms"]
    print(f"\nturn {args.turns} TTFT with reuse / without: {ratio:.3f} (target <= 0.2)")


if __name__ == "__main__":
    main()
