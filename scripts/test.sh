#!/usr/bin/env bash
# Install (first run only) and run the linter and the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
.venv/bin/ruff check lmserve tests scripts
# Two workers (pytest-xdist), a module's tests on one of them (tests/conftest.py): the in-process
# tests are single-threaded Python, so the fast subset takes about half the time (measured: 141 s
# against 247); the whole suite, whose servers already keep both cores busy, gains less. `-n 0`
# after it runs them in this process (a debugger, `-s`).
exec .venv/bin/python -m pytest -n 2 --dist loadgroup "$@"
