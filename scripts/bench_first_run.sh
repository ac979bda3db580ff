#!/usr/bin/env bash
# A newcomer's first ten minutes, measured: a fresh clone of this checkout, the README's serve
# command's install (scripts/setup.sh, from the package index), the venv it leaves (size and
# package count), and the time from starting the server to the first answer, on the first start
# after the install (kernels compiled) and on a second one (read from Numba's cache).
# Usage: scripts/bench_first_run.sh [WORKDIR]   (default: a new temporary directory; needs network)
set -euo pipefail
src="$(cd "$(dirname "$0")/.." && pwd)"
work="${1:-$(mktemp -d)}"
port=18999
git clone -q "$src" "$work/lmserve"
cd "$work/lmserve"
start=$(date +%s.%N)
scripts/setup.sh
install_s=$(echo "$(date +%s.%N) - $start" | bc)
venv_mb=$(du -sm .venv | cut -f1)
packages=$(.venv/bin/python -m pip list --format=freeze 2>/dev/null | wc -l)

first_answer() {  # seconds from starting the server to the end of its first reply
  local t0 reply
  t0=$(date +%s.%N)
  .venv/bin/lmserve-mac --port "$port" >"$work/server.log" 2>&1 &
  local pid=$!
  until curl -sf "localhost:$port/health" >/dev/null; do sleep 0.1; done
  reply=$(curl -s "localhost:$port/v1/messages" -H 'content-type: application/json' \
    -d '{"model":"x","max_tokens":24,"messages":[{"role":"user","content":"What is the capital of France?"}]}')
  echo "$(echo "$(date +%s.%N) - $t0" | bc) s: ${reply:0:160}" >&2
  echo "$(echo "$(date +%s.%N) - $t0" | bc)"
  kill "$pid"
  wait "$pid" || true
  grep "prepared" "$work/server.log" >&2 || true
}

first=$(first_answer)
second=$(first_answer)
printf 'install %.0f s; venv %s MB, %s packages; first answer %.1f s after the install, %.1f s on the next start\n' \
  "$install_s" "$venv_mb" "$packages" "$first" "$second"
