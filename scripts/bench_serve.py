"""Continuous batching under concurrent streaming clients: --batch 1 against --batch N, same run.

For each batch setting a fresh server is started; N clients stream greedy replies to distinct
prompts at once. Prints aggregate tok/s, time to first token and inter-token latency (p50, p99),
the lone-request decode speed on each server, and the ratios.

    python scripts/bench_serve.py --clients 4 --tokens 64

--long-prompt: chunked prefill against whole-prompt prefill, same run. On a server with --batch N
(default 4), N-1 clients stream long greedy replies (end of turn banned) while one more sends a
unique ~4,000-token prompt; the streams' inter-token gaps during the window in which that prompt
is prefilled (from its sending to its first token) are measured on a server started with
--prefill-chunk 0 (the baseline) and on one with the default chunk (or --prefill-chunk N).

    python scripts/bench_serve.py --long-prompt --batch 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.server_util import start_server  # noqa: E402

TOPICS = ["the ocean", "mountains", "a city at night", "winter", "a library", "trains", "bread", "rain"]
NO_EOS = {"0": -100, "1": -100, "2": -100}  # SmolLM2's end-of-turn ids (the default model), as the tests ban them
WARM_TOKENS = 8  # tokens each stream has delivered before the long prompt is sent


def stream_one(base_url: str, prompt: str, tokens: int, logit_bias: dict[str, int] | None = None) -> dict:
    """One streaming chat request; returns its token arrival times."""
    body = {"messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": tokens,
            "stream": True, **({"logit_bias": logit_bias} if logit_bias else {})}
    start = time.perf_counter()
    arrivals: list[float] = []
    record_arrivals(base_url, body, arrivals)
    return {"start": start, "arrivals": arrivals}


def record_arrivals(base_url: str, body: dict, arrivals: list[float], stop: threading.Event | None = None) -> None:
    """Stream a chat request, appending the arrival time of each content chunk; leave once `stop` is set."""
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    arrivals.append(time.perf_counter())
            if stop is not None and stop.is_set():
                return


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


def gaps_in(arrivals: list[float], start: float, end: float) -> list[float]:
    """Gaps between consecutive arrivals that overlap the window [start, end]."""
    return [b - a for a, b in zip(arrivals, arrivals[1:], strict=False) if b > start and a < end]


def unique_long_prompt(base_url: str, tokens: int) -> tuple[str, int]:
    """A prompt of about `tokens` tokens (chat-templated) that starts with a fresh tag, so that no
    KV slot holds any of it; returns it with its measured length."""
    tag = uuid.uuid4().hex

    def text(lines: int) -> str:
        notes = "".join(f"Note {i}: {TOPICS[i % len(TOPICS)]}, entry {i * 7919 % 100003}.\n" for i in range(lines))
        return f"[{tag}] Read these notes, then summarise them in one line.\n{notes}"

    def count(lines: int) -> int:
        body = {"messages": [{"role": "user", "content": text(lines)}]}
        return httpx.post(base_url + "/v1/messages/count_tokens", json=body, timeout=60).json()["input_tokens"]

    base, per = count(0), (count(200) - count(0)) / 200
    lines = max(1, round((tokens - base) / per))
    return text(lines), count(lines)


def stream_until(base_url: str, prompt: str, tokens: int, stop: threading.Event, arrivals: list[float]) -> None:
    """A greedy stream that cannot end early (end of turn banned); the client leaves once `stop` is set."""
    body = {"messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": tokens,
            "logit_bias": NO_EOS, "stream": True}
    record_arrivals(base_url, body, arrivals, stop)


def measure_long_prompt(chunk: int | None, batch: int, prompt_tokens: int, ctx: int, model: str | None) -> dict:
    """Gaps of batch-1 streams while one long prompt is prefilled; `chunk` None: the server's default."""
    args = [*([model] if model else []), "--engine", "cpu", "--batch", str(batch), "--kv-slots", str(batch),
            "--ctx", str(ctx), *(["--prefill-chunk", str(chunk)] if chunk is not None else [])]
    with start_server(*args) as server:
        stream_one(server.base_url, "Say hi.", 4)  # warm-up
        prompt, counted = unique_long_prompt(server.base_url, prompt_tokens)
        stop = threading.Event()
        streams: list[list[float]] = [[] for _ in range(batch - 1)]
        threads = [threading.Thread(target=stream_until, args=(
            server.base_url, f"Write a long story about {TOPICS[i % len(TOPICS)]}.", ctx // 2, stop, streams[i]))
            for i in range(batch - 1)]
        for t in threads:
            t.start()
        deadline = time.perf_counter() + 120
        while min(len(a) for a in streams) < WARM_TOKENS and time.perf_counter() < deadline:
            time.sleep(0.01)
        if min(len(a) for a in streams) < WARM_TOKENS:
            stop.set()
            raise SystemExit("the streams did not start")
        sent = time.perf_counter()
        long = stream_one(server.base_url, prompt, 2, NO_EOS)
        first = long["arrivals"][0] if long["arrivals"] else None
        deadline = time.perf_counter() + 60
        while (first is not None and min(a[-1] for a in streams) <= first and time.perf_counter() < deadline
               and all(t.is_alive() for t in threads)):
            time.sleep(0.01)  # the window closes at every stream's next token
        stop.set()
        for t in threads:
            t.join()
    if first is None:
        raise SystemExit("the long prompt got no reply token")
    if any(a[-1] <= first for a in streams):
        raise SystemExit("a stream ended before the long prompt's first token: raise --ctx")
    window = [g for a in streams for g in gaps_in(a, sent, first)]
    before = [b - a for s in streams for a, b in zip(s, s[1:], strict=False) if b <= sent]
    return {
        "prompt_tokens": counted, "ttft": first - sent, "gaps": len(window),
        "itl_before_p50": pct(before, 0.5),
        "itl_p50": pct(window, 0.5), "itl_p99": pct(window, 0.99), "itl_max": max(window),
    }


def long_prompt_main(args: argparse.Namespace) -> None:
    batch = args.batch or 4
    if batch < 2:
        raise SystemExit("--long-prompt needs --batch 2 or more (streams plus the long prompt)")
    chunk = args.prefill_chunk
    whole = measure_long_prompt(0, batch, args.prompt_tokens, args.ctx, args.model)
    chunked = measure_long_prompt(chunk, batch, args.prompt_tokens, args.ctx, args.model)
    label = f"--prefill-chunk {chunk if chunk is not None else 'default'}"
    print(f"\n{batch - 1} greedy streams, one {whole['prompt_tokens']}-token prompt prefilled meanwhile, "
          f"--batch {batch} --ctx {args.ctx}, NumPy engine")
    print(f"{'metric':<36}{'--prefill-chunk 0':>20}{label:>24}{'ratio':>9}")
    rows = [("long prompt TTFT (s)", "ttft"), ("stream gaps in the prefill window", "gaps"),
            ("inter-token p50 before it (s)", "itl_before_p50"), ("inter-token p50 in the window (s)", "itl_p50"),
            ("inter-token p99 in the window (s)", "itl_p99"), ("inter-token max in the window (s)", "itl_max")]
    for name, key in rows:
        cell = "" if key == "gaps" else ".3f"
        print(f"{name:<36}{whole[key]:>20{cell}}{chunked[key]:>24{cell}}{chunked[key] / whole[key]:>9.2f}")
    print(f"\ninter-token p99 ratio chunked/unchunked (target <= 0.2): {chunked['itl_p99'] / whole['itl_p99']:.2f}")


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
    p.add_argument("--batch", type=int, default=None, help="batch size to compare with 1 (default: clients; --long-prompt: 4)")
    p.add_argument("--tokens", type=int, default=64, help="tokens per reply")
    p.add_argument("--model", default=None, help="GGUF path (default: embedded SmolLM2)")
    p.add_argument("--long-prompt", action="store_true",
                   help="measure streams' inter-token gaps while a long prompt is prefilled, chunked vs not")
    p.add_argument("--prompt-tokens", type=int, default=4000, help="--long-prompt: length of the long prompt")
    p.add_argument("--ctx", type=int, default=8192, help="--long-prompt: server context size")
    p.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                   help="--long-prompt: the chunked server's --prefill-chunk (default: the server's own)")
    args = p.parse_args()
    if args.long_prompt:
        long_prompt_main(args)
        return
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
