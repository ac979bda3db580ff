#!/usr/bin/env bash
# Install the agent clients the suite runs for real (tests/test_agent_clients.py), at the versions
# it was written against, into .agents/ (ignored by git). Needs Node.js and npm.
set -euo pipefail
cd "$(dirname "$0")/.."
CLAUDE_CODE=2.1.197
CODEX=0.171.0
have() { [ -x .agents/node_modules/.bin/"$1" ] && .agents/node_modules/.bin/"$1" --version 2>/dev/null | grep -q "$2"; }
if have claude "$CLAUDE_CODE" && have codex "$CODEX"; then
  exit 0
fi
npm install --prefix .agents --no-audit --no-fund --no-save --loglevel=error \
  "@anthropic-ai/claude-code@$CLAUDE_CODE" "@openai/codex@$CODEX"
.agents/node_modules/.bin/claude --version
.agents/node_modules/.bin/codex --version
