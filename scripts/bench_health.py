"""/health latency while CPU-heavy requests run: six 3 MB `/v1/messages/count_tokens` bodies at once
(parsing, rendering, tokenizing: the work that runs on worker threads, not the event loop) while
/health is probed every 50 ms. Prints the probes' p50 / p99 / max.

    python scripts/bench_health.py [--bodies 6] [--megabytes 3]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import time
from collections.abc import Callable
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
    # Encoded once: six client threads each encoding 3 MB of JSON would hold this process's GIL,
    # and the probes (threads of this process too) would time the client, not the server.
    payload = json.dumps({"model": "claude-haiku-4-5", "messages": [{"role": "user", "content": text}]}).encode()
    with (start_server("--ctx", "2048") as server, concurrent.futures.ThreadPoolExecutor(args.bodies) as pool,
          httpx.Client(base_url=server.base_url, headers={"Connection": "close"}, timeout=60) as probe):
        def probes(until: Callable[[], bool]) -> np.ndarray:
            """/health latencies (ms), a new connection each, every 50 ms until `until()`."""
            latencies = []
            while not until():
                t = time.perf_counter()
                probe.get("/health").raise_for_status()
                latencies.append(time.perf_counter() - t)
                time.sleep(0.05)
            return np.array(latencies) * 1000

        time.sleep(5)  # the server's warm-up pass, which runs once /health answers
        quiet_until = time.perf_counter() + 3
        quiet = probes(lambda: time.perf_counter() > quiet_until)
        started = time.perf_counter()
        counts = [pool.submit(httpx.post, server.base_url + "/v1/messages/count_tokens", content=payload,
                              headers={"Content-Type": "application/json"}, timeout=600) for _ in range(args.bodies)]
        loaded = probes(lambda: all(f.done() for f in counts))
        took = time.perf_counter() - started
        assert all(f.result().status_code == 200 for f in counts)
    print(f"/health with nothing else running, {len(quiet)} probes: {_percentiles(quiet)}")
    print(f"{args.bodies} x {args.megabytes:g} MB count_tokens in {took:.1f} s; /health over {len(loaded)} probes "
          f"meanwhile: {_percentiles(loaded)}")


def _percentiles(ms: np.ndarray) -> str:
    return f"p50 {np.percentile(ms, 50):.1f} ms, p99 {np.percentile(ms, 99):.1f} ms, max {ms.max():.1f} ms"

if __name__ == "__main__":
    main()
