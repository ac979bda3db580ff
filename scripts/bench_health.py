"""/health latency while CPU-heavy requests run: six 3 MB `/v1/messages/count_tokens` bodies at once
(parsing, rendering, tokenizing: the work that runs on worker threads, not the event loop) while
/health is probed every 50 ms. Prints the probes' p50 / p99 / max.

    python scripts/bench_health.py [--bodies 6] [--megabytes 3]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import sys
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.server_util import start_server  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bodies", type=int, default=6)
    p.add_argument("--megabytes", type=float, default=3.0)
    args = p.parse_args()
    text = "lorem ipsum dolor sit amet " * int(args.megabytes * 1e6 / 27)
    body = {"model": "claude-haiku-4-5", "messages": [{"role": "user", "content": text}]}
    with start_server("--ctx", "2048") as server, concurrent.futures.ThreadPoolExecutor(args.bodies) as pool:
        started = time.perf_counter()
        counts = [pool.submit(httpx.post, server.base_url + "/v1/messages/count_tokens", json=body, timeout=600)
                  for _ in range(args.bodies)]
        latencies = []
        while not all(f.done() for f in counts):
            t = time.perf_counter()
            httpx.get(server.base_url + "/health", timeout=60).raise_for_status()
            latencies.append(time.perf_counter() - t)
            time.sleep(0.05)
        took = time.perf_counter() - started
        assert all(f.result().status_code == 200 for f in counts)
    ms = np.array(latencies) * 1000
    print(f"{args.bodies} x {args.megabytes:g} MB count_tokens in {took:.1f} s; /health over {len(ms)} probes: "
          f"p50 {np.percentile(ms, 50):.1f} ms, p99 {np.percentile(ms, 99):.1f} ms, max {ms.max():.1f} ms")


if __name__ == "__main__":
    main()
