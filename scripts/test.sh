#!/usr/bin/env bash
# Install (first run only) and run the linter and the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
.venv/bin/ruff check lmserve tests scripts
exec .venv/bin/python -m pytest "$@"
