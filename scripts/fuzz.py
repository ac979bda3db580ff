"""Run the fuzz suite (tests/test_fuzz.py) with more examples and fresh randomness than CI's
derandomized short form: hostile bodies for every route, raw bytes and content types, and
schemathesis cases from /openapi.json, each checked for a 4xx in the dialect's envelope or a
well-formed 200, never a 5xx, a hang or a traceback.

    python scripts/fuzz.py --examples 500            # every fuzz test, 500 examples each
    python scripts/fuzz.py --examples 2000 -k chat   # other arguments go to pytest
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--examples", type=int, default=500, help="hypothesis examples per fuzz test (default 500)")
    p.add_argument("--seed", type=int, default=None, help="hypothesis seed, to replay a run")
    args, pytest_args = p.parse_known_args()
    env = {**os.environ, "LMSERVE_FUZZ_EXAMPLES": str(args.examples), "LMSERVE_FUZZ_RANDOM": "1"}
    command = [sys.executable, "-m", "pytest", str(ROOT / "tests" / "test_fuzz.py"), "-p", "no:cacheprovider",
               "--timeout", "0", "-q", "-s", *pytest_args]
    if args.seed is not None:
        command.append(f"--hypothesis-seed={args.seed}")
    return subprocess.call(command, cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main())
