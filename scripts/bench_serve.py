"""Continuous batching under concurrent streaming clients: --batch 1 against --batch N, same run.

For each batch setting a fresh server is started; N clients stream greedy replies to distinct
prompts at once. Prints aggregate tok/s, time to first token and inter-token latency (p50, p99),
the lone-request decode speed on each server, and the ratios.

    python scripts/bench_serve.py --clients 4 --tokens 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.server_util import start_server  # noqa: E402

TOPICS = ["the ocean", "mountains", "a city at night", "winter", "a library", "trains", "bread", "rain"]


def stream_one(base_url: str, prompt: str, tokens: int) -> dict:
    """One streaming chat request; returns its token arrival times."""
    body = {"messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": tokens,
            "stream": True}
    start = time.perf_counter()
    arrivals = []
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    arrivals.append(time.perf_counter())
    return {"start": start, "arrivals": arrivals}


def run_clients(base_url: str, clients: int, tokens: int) -> list[dict]:
    results: list[dict] = [{} for _ in range(clients)]

    def work(i: int) -> None:
        results[i] = stream_one(base_url, f"Write a long story about {TOPICS[i % len(TOPICS)]}.", tokens)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def measure(batch: int, clients: int, tokens: int, model: str | None) -> dict:
    args = [*([model] if model else []), "--engine", "cpu", "--batch", str(batch),
            "--kv-slots", str(max(batch, clients))]
    with start_server(*args) as server:
        stream_one(server.base_url, "Say hi.", 4)  # warm-up
        lone = stream_one(server.base_url, "Write a long story about a lighthouse.", tokens)
        t0 = time.perf_counter()
        results = run_clients(server.base_url, clients, tokens)
        wall = time.perf_counter() - t0
    produced = sum(len(r["arrivals"]) for r in results)
    ttft = [r["arrivals"][0] - r["start"] for r in results if r["arrivals"]]
    itl = [b - a for r in results for a, b in zip(r["arrivals"], r["arrivals"][1:], strict=False)]
    lone_gaps = [b - a for a, b in zip(lone["arrivals"], lone["arrivals"][1:], strict=False)]
    return {
        "aggregate": produced / wall,
        "ttft_p50": pct(ttft, 0.5), "ttft_p99": pct(ttft, 0.99),
        "itl_p50": pct(itl, 0.5), "itl_p99": pct(itl, 0.99),
        "lone": 1.0 / statistics.mean(lone_gaps) if lone_gaps else float("nan"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--batch", type=int, default=None, help="batch size to compare with 1 (default: clients)")
    p.add_argument("--tokens", type=int, default=64, help="tokens per reply")
    p.add_argument("--model", default=None, help="GGUF path (default: embedded SmolLM2)")
    args = p.parse_args()
    batch = args.batch or args.clients
    one = measure(1, args.clients, args.tokens, args.model)
    many = measure(batch, args.clients, args.tokens, args.model)
    print(f"\n{args.clients} concurrent streaming clients, {args.tokens} tokens each, NumPy engine")
    print(f"{'metric':<26}{'--batch 1':>12}{f'--batch {batch}':>12}{'ratio':>9}")
    rows = [("aggregate tok/s", "aggregate"), ("TTFT p50 (s)", "ttft_p50"), ("TTFT p99 (s)", "ttft_p99"),
            ("inter-token p50 (s)", "itl_p50"), ("inter-token p99 (s)", "itl_p99"),
            ("lone request tok/s", "lone")]
    for label, key in rows:
        print(f"{label:<26}{one[key]:>12.3f}{many[key]:>12.3f}{many[key] / one[key]:>9.2f}")
    print(f"\naggregate ratio (target >= 2.0): {many['aggregate'] / one['aggregate']:.2f}")
    print(f"lone-request ratio (target >= 0.95): {many['lone'] / one['lone']:.2f}")


if __name__ == "__main__":
    main()
