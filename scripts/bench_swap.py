"""Model swap time: the time to first token of a request that has to load its model, cold (file
not in the page cache) and warm (just unloaded, file cached), against a request to a resident model
in the same run, and the server's own load time (`/models/status`).

    python scripts/bench_swap.py [--model GGUF] [--rounds 3]

The server starts with the embedded SmolLM2 and `--models-dir` holding a link to `--model`
(default: the synthetic Qwen3-MoE of scripts/synthetic_moe.py, written to a temporary folder).
Cold rounds drop the page cache (`/proc/sys/vm/drop_caches`, root only; without it every round
is warm and the script says so).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from synthetic_moe import write as write_moe  # noqa: E402

from tests.server_util import chat_chunks, start_server  # noqa: E402

QUESTION = [{"role": "user", "content": "Say something."}]


def ttft(base_url: str, model: str | None) -> float:
    body = {"messages": QUESTION, "max_tokens": 2, "temperature": 0, "stream": True}
    if model:
        body["model"] = model
    start = time.perf_counter()
    for chunk in chat_chunks(base_url, body):
        if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content") is not None:
            return time.perf_counter() - start
    return time.perf_counter() - start


def drop_page_cache() -> bool:
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def unload(base_url: str, name: str) -> None:
    """Unload `name` once its last request has let go (a stream closed at its first token is
    cancelled at the worker's next step: until then the model is busy, a 409)."""
    deadline = time.monotonic() + 30
    while (r := httpx.post(base_url + "/models/unload", json={"model": name}, timeout=60)).status_code == 409:
        if time.monotonic() > deadline:
            r.raise_for_status()
        time.sleep(0.05)
    r.raise_for_status()


def load_seconds(base_url: str, name: str) -> float:
    models = httpx.get(base_url + "/models/status", timeout=30).json()["models"]
    return next(m["load_seconds"] for m in models if m["id"] == name)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None, help="the model to swap in (default: a synthetic MoE)")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model = args.model
        if model is None:
            model = folder / "source.gguf"
            write_moe(model, 12, 1024, 32, 4, 512)
        size = model.stat().st_size / 2**20
        (folder / "models").mkdir()
        (folder / "models" / "swapped.gguf").symlink_to(model.resolve())
        figures: dict[str, list[float]] = {"resident": [], "cold": [], "warm": [], "cold_load": [], "warm_load": []}
        with start_server("--models-dir", str(folder / "models"), "--ctx", "2048") as server:
            url = server.base_url
            cold_ok = True
            for _ in range(args.rounds):
                figures["resident"].append(ttft(url, None))
                cold_ok = drop_page_cache() and cold_ok
                figures["cold"].append(ttft(url, "swapped"))
                figures["cold_load"].append(load_seconds(url, "swapped"))
                unload(url, "swapped")
                figures["warm"].append(ttft(url, "swapped"))
                figures["warm_load"].append(load_seconds(url, "swapped"))
                unload(url, "swapped")
    print(f"{args.model or 'synthetic MoE'} ({size:.0f} MiB), best of {args.rounds} rounds"
          + ("" if cold_ok else " (page cache not dropped: 'cold' is warm too)"))
    resident = min(figures["resident"])
    for key, label in (("cold", "TTFT, model loaded by the request, cold"),
                       ("warm", "TTFT, model loaded by the request, warm")):
        best = min(figures[key])
        print(f"{label:<45} {best * 1000:8.0f} ms  ({best / resident:6.1f}x the resident model's "
              f"{resident * 1000:.0f} ms); server load {min(figures[key + '_load']):.2f} s")


if __name__ == "__main__":
    main()
