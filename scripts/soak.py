"""Soak test: N concurrent clients for T minutes against a fresh lmserve, mixing the four dialects
(chat, responses, messages, legacy completions), streaming and not, tools and grammars, client
disconnects mid-stream, stalled readers, non-streaming requests the client hangs up on, bad requests
and prompts at and over the context limit. Every reply is checked as it completes; afterwards the
server must be idle (queue, batch rows, KV slots) with resident memory within 5% of its level after
warm-up and no more client_closed requests in /metrics than the clients cut, then exit 0 on SIGTERM.
Prints a summary table; exits 1 on any failure.

    python scripts/soak.py --clients 8 --minutes 30
    python scripts/soak.py --clients 4 --minutes 2 --sigterm-after 60   # stop it mid-load
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.server_util import start_server  # noqa: E402
from tests.soak import Soak, table  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--ctx", type=int, default=2048, help="server context size (long prompts fill it)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--kv-slots", type=int, default=4)
    p.add_argument("--queue", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sigterm-after", type=float, default=None, metavar="SECONDS",
                   help="send SIGTERM this long into the run: streams must end properly, exit status 0")
    p.add_argument("--engine", default="cpu")
    args = p.parse_args()
    flags = ["--engine", args.engine, "--ctx", str(args.ctx), "--batch", str(args.batch),
             "--kv-slots", str(args.kv_slots), "--queue", str(args.queue)]
    with start_server(*flags) as server:
        soak = Soak(server, args.ctx, args.seed)
        report = soak.run(args.clients, args.minutes * 60, soak.warm_up(), args.sigterm_after)
        if args.sigterm_after is None:
            soak.stop(report)
    print(f"soak: {args.clients} clients, {args.minutes:g} min, server {' '.join(flags)}\n")
    print(table(report))
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
