"""lmserve against llama.cpp's own llama-server: the same GGUF, the same streaming chat requests.

Both servers are driven over /v1/chat/completions with streaming, greedy (temperature 0), every
reply exactly --tokens long (llama-server: "ignore_eos"; lmserve: its end-of-turn ids banned by
logit_bias on the default model, else replies may end early and the tokens are counted from usage).
Rounds alternate the two servers, one running at a time, and the best of each figure is kept.

    python scripts/bench_peer.py --llama-server ~/.cache/lmserve-peers/bin/llama-server

Figures: decode tok/s of one stream (between its first and last token), aggregate tok/s of
--streams concurrent streams (all their tokens over the wall time), prompt tok/s of a cold
~1,100-token prompt (its prompt tokens over the time to first token), and the time to first
token of a second conversation sharing that prompt's system prompt, divided by the cold one.
With --long-context N, also the decode tok/s of one stream after an N-token prompt (a long agent
session's turn: attention reads N cached positions a token), e.g. with quantized KV on both:

    python scripts/bench_peer.py --long-context 16000 --ctx 16640 --llama-arg=--no-repack \
        --llama-arg=-ctk --llama-arg=q8_0 --llama-arg=-ctv --llama-arg=q8_0 --lmserve-arg=--kv-type=q8_0
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import NO_EOS, TOPICS  # noqa: E402  (bench_serve puts the repo root on sys.path)

from lmserve.model.default_model import default_model_path  # noqa: E402
from lmserve.model.gguf_file import GGUFFile  # noqa: E402
from lmserve.model.tokenizer import Tokenizer  # noqa: E402
from tests.server_util import chat_chunks, free_port, start_server, stop_process, wait_until_healthy  # noqa: E402

DEFAULT_PEER = Path.home() / ".cache" / "lmserve-peers" / "bin" / "llama-server"
# Every request goes through one client made at start: a client made for each request spent 18-31
# ms on its TLS set-up, and four concurrent streams' requests left about 100 ms after the clock
# started, which both servers' aggregate figures counted as theirs. Each request has a connection
# of its own (no keep-alive): llama-server closed an idle one as a request went out on it.
CLIENT = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))
QUESTIONS = ["Which note mentions trains first? Answer in one line.",
             "How many notes are about rain? Answer in one line."]


def stream_chat(base_url: str, messages: list[dict], tokens: int, extra: dict) -> dict:
    """One streaming chat request: send time, content-chunk arrival times and the usage reported."""
    body = {"messages": messages, "temperature": 0, "max_tokens": tokens, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    arrivals: list[float] = []
    usage: dict = {}
    start = time.perf_counter()
    for chunk in chat_chunks(base_url, body, client=CLIENT):
        if chunk.get("usage"):
            usage = chunk["usage"]
        if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
            arrivals.append(time.perf_counter())
    if not arrivals:
        raise SystemExit(f"{base_url}: a reply without content")
    produced = usage.get("completion_tokens") or len(arrivals)
    return {"start": start, "arrivals": arrivals, "produced": produced, "prompt": usage.get("prompt_tokens", 0),
            "ttft": arrivals[0] - start, "end": arrivals[-1]}


def system_prompt(tokenizer: Tokenizer, tokens: int) -> str:
    """A system prompt of about `tokens` tokens that starts with a fresh tag: no server has any of it cached."""
    tag = uuid.uuid4().hex

    def text(lines: int) -> str:
        notes = "".join(f"Note {i}: {TOPICS[i % len(TOPICS)]}, entry {i * 7919 % 100003}.\n" for i in range(lines))
        return f"[{tag}] You answer questions about these notes.\n{notes}"

    per_line = (len(tokenizer.encode(text(100))) - len(tokenizer.encode(text(0)))) / 100
    lines = max(1, round((tokens - len(tokenizer.encode(text(0)))) / per_line))
    for _ in range(3):  # later notes' longer numbers take more tokens a line: correct from the count
        lines = max(1, lines + round((tokens - len(tokenizer.encode(text(lines)))) / per_line))
    return text(lines)


def measure(base_url: str, extra: dict, args: argparse.Namespace, tokenizer: Tokenizer) -> dict[str, float]:
    """Every figure on one running server."""
    def story(i: int) -> list[dict]:
        return [{"role": "user", "content": f"Write a long story about {TOPICS[i % len(TOPICS)]}."}]

    stream_chat(base_url, story(7), 8, extra)  # warm-up: first-call setup on both sides
    lone = stream_chat(base_url, story(0), args.tokens, extra)
    decode = (lone["produced"] - 1) / (lone["end"] - lone["arrivals"][0])

    results: list[dict] = [{} for _ in range(args.streams)]

    def work(i: int) -> None:
        results[i] = stream_chat(base_url, story(i + 1), args.tokens, extra)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(args.streams)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if not all(results):
        raise SystemExit(f"{base_url}: a concurrent stream failed")
    aggregate = sum(r["produced"] for r in results) / (max(r["end"] for r in results) - start)

    system = system_prompt(tokenizer, args.prompt_tokens)
    cold = stream_chat(base_url, [{"role": "system", "content": system}, {"role": "user", "content": QUESTIONS[0]}],
                       2, extra)
    warm = stream_chat(base_url, [{"role": "system", "content": system}, {"role": "user", "content": QUESTIONS[1]}],
                       2, extra)
    figures = {"decode": decode, "aggregate": aggregate, "prompt": cold["prompt"] / cold["ttft"],
               "shared": warm["ttft"] / cold["ttft"], "prompt_tokens": cold["prompt"],
               "lone_tokens": lone["produced"], "streams_tokens": sum(r["produced"] for r in results) / args.streams}
    if args.long_context:
        long = stream_chat(base_url, [{"role": "system", "content": system_prompt(tokenizer, args.long_context)},
                                      {"role": "user", "content": "Write a long story about the notes."}],
                           args.tokens, extra)
        figures["long_decode"] = (long["produced"] - 1) / (long["end"] - long["arrivals"][0])
        figures["long_prompt_tokens"] = long["prompt"]
    return figures


@contextlib.contextmanager
def llama_server(binary: Path, model: Path, ctx: int, streams: int, extra: list[str],
                 timeout: float = 120.0) -> Iterator[str]:
    """Run llama-server on a free loopback port; yield its base URL once /health says it is ready."""
    port = free_port()
    command = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), *llama_args(ctx, streams, extra)]
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        base_url = f"http://127.0.0.1:{port}"
        def output() -> str:
            log.seek(0)
            return log.read().decode(errors="replace")

        try:
            wait_until_healthy(proc, base_url, timeout, output)
            yield base_url
        finally:
            stop_process(proc)


def llama_args(ctx: int, streams: int, extra: list[str]) -> list[str]:
    return ["-t", "2", "-np", str(streams), "--jinja", "-c", str(ctx), *extra]


def lmserve_args(ctx: int, streams: int, extra: list[str]) -> list[str]:
    return ["--batch", str(streams), "--kv-slots", str(streams), "--ctx", str(ctx), *extra]


def run_lmserve(args: argparse.Namespace, tokenizer: Tokenizer, default_model: bool) -> dict[str, float]:
    extra = {"logit_bias": NO_EOS} if default_model else {}
    with start_server(str(args.model), *lmserve_args(args.ctx, args.streams, args.lmserve_arg)) as server:
        return measure(server.base_url, extra, args, tokenizer)


def run_llama(args: argparse.Namespace, tokenizer: Tokenizer) -> dict[str, float]:
    with llama_server(args.llama_server, args.model, args.ctx, args.streams, args.llama_arg) as base_url:
        return measure(base_url, {"ignore_eos": True}, args, tokenizer)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-server", type=Path, default=DEFAULT_PEER, help=f"llama-server binary (default: {DEFAULT_PEER})")
    p.add_argument("--model", type=Path, default=None, help="GGUF served by both (default: the embedded SmolLM2 Q4_1)")
    p.add_argument("--tokens", type=int, default=128, help="tokens per decoded reply")
    p.add_argument("--streams", type=int, default=4, help="concurrent streams; also --batch/--kv-slots and -np")
    p.add_argument("--prompt-tokens", type=int, default=1100, help="length of the cold prompt")
    p.add_argument("--ctx", type=int, default=8192, help="context size of both servers")
    p.add_argument("--llama-arg", action="append", default=None, metavar="ARG",
                   help="extra llama-server argument (repeatable; default: --no-repack: a GGML_NATIVE build on a "
                        "CPU that reports AMX runs AMX tile kernels, which die of SIGILL where the VM does not "
                        "enable AMX; Q4_1 has no CPU repack, so ggml's AVX-512 kernels run instead)")
    p.add_argument("--lmserve-arg", action="append", default=[], metavar="ARG",
                   help="extra lmserve argument (repeatable), e.g. --lmserve-arg=--speculate --lmserve-arg=off")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds; the best of each figure is kept")
    p.add_argument("--long-context", type=int, default=0, metavar="N",
                   help="also decode one stream after an N-token prompt (needs --ctx above N + --tokens)")
    args = p.parse_args()
    args.llama_arg = ["--no-repack"] if args.llama_arg is None else args.llama_arg
    default_model = args.model is None
    args.model = args.model or default_model_path()
    if not args.llama_server.exists():
        raise SystemExit(f"no llama-server at {args.llama_server} (build one: ../shared/tools/build-llama-server.sh)")
    tokenizer = Tokenizer.from_gguf(GGUFFile(args.model))
    runs: dict[str, list[dict[str, float]]] = {"lmserve": [], "llama-server": []}
    for r in range(args.rounds):
        order = ["lmserve", "llama-server"] if r % 2 == 0 else ["llama-server", "lmserve"]
        for name in order:
            figures = run_lmserve(args, tokenizer, default_model) if name == "lmserve" else run_llama(args, tokenizer)
            runs[name].append(figures)
            print(f"round {r + 1} {name}: " + ", ".join(f"{k} {v:.3g}" for k, v in figures.items()), flush=True)
    lower_better = {"shared"}
    best = {name: {k: (min if k in lower_better else max)(f[k] for f in figures) for k in figures[0]}
            for name, figures in runs.items()}
    ours, theirs = best["lmserve"], best["llama-server"]
    print(f"\n{args.model.name}, best of {args.rounds} alternating rounds; "
          f"llama-server {' '.join(llama_args(args.ctx, args.streams, args.llama_arg))}; "
          f"lmserve {' '.join(lmserve_args(args.ctx, args.streams, args.lmserve_arg))}")
    rows = [("decode, 1 stream (tok/s)", "decode", ".1f"),
            (f"aggregate, {args.streams} streams (tok/s)", "aggregate", ".1f"),
            (f"prompt, ~{ours['prompt_tokens']:.0f} tokens (tok/s, from TTFT)", "prompt", ".0f"),
            ("TTFT shared system prompt / cold", "shared", ".3f")]
    if args.long_context:
        rows.append((f"decode after ~{ours['long_prompt_tokens']:.0f} cached tokens (tok/s)", "long_decode", ".1f"))
    width = max(len(label) for label, _, _ in rows)
    print(f"{'metric':<{width}}  {'lmserve':>9}  {'llama-server':>12}  {'lmserve/llama':>13}")
    for label, key, fmt in rows:
        print(f"{label:<{width}}  {ours[key]:>9{fmt}}  {theirs[key]:>12{fmt}}  {ours[key] / theirs[key]:>13.2f}")
    print(f"tokens per reply: lmserve {ours['lone_tokens']:.0f} (lone), {ours['streams_tokens']:.0f} (concurrent mean); "
          f"llama-server {theirs['lone_tokens']:.0f}, {theirs['streams_tokens']:.0f}")


if __name__ == "__main__":
    main()
