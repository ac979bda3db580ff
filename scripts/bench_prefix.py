"""KV reuse on SmolLM2 with a long shared system prompt: time to first token, all in one run.

1. cold: conversation A's first turn (nothing cached);
2. conversation B with the same system prompt (target <= 0.15x cold);
3. A's follow-up turn (target <= 0.10x cold);
4. after a restart over the same --kv-cache-dir, A's next turn restored from disk (<= 0.20x cold).

    python scripts/bench_prefix.py
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.server_util import chat_chunks, start_server  # noqa: E402

RULES = ("Rule {i}: when a customer asks about item {i}, check aisle {a}, confirm the price, mention the "
         "warranty, and offer help with installation or returns if they need it. ")


def system_prompt(tokens: int) -> str:
    """About `tokens` tokens of distinct store rules (SmolLM2 spends ~36 tokens per rule)."""
    return "You are the assistant of a hardware store.\n" + "".join(
        RULES.format(i=i, a=i % 17) for i in range(tokens // 36))


def ttft(base_url: str, messages: list[dict]) -> tuple[float, str, dict]:
    """Seconds to the first streamed token, the reply text, and the usage."""
    body = {"messages": messages, "temperature": 0, "max_tokens": 16, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, text, usage = None, "", {}
    for chunk in chat_chunks(base_url, body, timeout=900):
        if chunk.get("usage"):
            usage = chunk["usage"]
        if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
            first = first or time.perf_counter()
            text += chunk["choices"][0]["delta"]["content"]
    return (first or time.perf_counter()) - start, text, usage


def wait_warm(base_url: str) -> None:
    """Let the new process finish its one-time warm-up (importing the tool parsers) so the
    restore is timed on its own."""
    while not httpx.get(base_url + "/health").json().get("warm"):
        time.sleep(0.1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--system-tokens", type=int, default=1800)
    p.add_argument("--model", default=None, help="GGUF path (default: embedded SmolLM2)")
    args = p.parse_args()
    system = {"role": "system", "content": system_prompt(args.system_tokens)}
    a1 = [system, {"role": "user", "content": "Where are the hammers?"}]
    b1 = [system, {"role": "user", "content": "Do you rent tools?"}]
    rows = []
    with tempfile.TemporaryDirectory() as kv_dir:
        server_args = [*([args.model] if args.model else []), "--engine", "cpu", "--kv-slots", "4",
                       "--kv-cache-dir", kv_dir]
        with start_server(*server_args) as server:
            wait_warm(server.base_url)
            cold, reply_a, usage = ttft(server.base_url, a1)
            rows.append(("A turn 1 (cold)", cold, usage, None))
            t, _, usage = ttft(server.base_url, b1)
            rows.append(("B turn 1 (shared system)", t, usage, 0.15))
            a2 = a1 + [{"role": "assistant", "content": reply_a}, {"role": "user", "content": "And nails?"}]
            t, reply_a2, usage = ttft(server.base_url, a2)
            rows.append(("A turn 2 (follow-up)", t, usage, 0.10))
        # The shutdown spilled the slots to disk; a new process restores A from there.
        with start_server(*server_args) as server:
            wait_warm(server.base_url)
            a3 = a2 + [{"role": "assistant", "content": reply_a2}, {"role": "user", "content": "Screws?"}]
            t, _, usage = ttft(server.base_url, a3)
            rows.append(("A turn 3 (after restart)", t, usage, 0.20))
    print(f"\nSmolLM2, NumPy engine, shared system prompt of {rows[0][2]['prompt_tokens']} prompt tokens")
    print(f"{'request':<28}{'TTFT s':>9}{'prompt':>8}{'cached':>8}{'x cold':>9}{'target':>9}")
    for name, t, usage, target in rows:
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        ratio = t / cold
        verdict = "" if target is None else f"<= {target:.2f} {'ok' if ratio <= target else 'MISSED'}"
        print(f"{name:<28}{t:>9.3f}{usage['prompt_tokens']:>8}{cached:>8}{ratio:>9.3f}  {verdict}")


if __name__ == "__main__":
    main()
