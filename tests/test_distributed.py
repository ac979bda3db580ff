"""`--distributed`: two ranks started by `mlx.launch --backend ring` on loopback (MLX's CPU
backend here) serve the same greedy replies over HTTP as one `--engine mlx` process, reuse cached
prefixes, and a rank killed mid-stream ends the group with one clear line within a bound. The
lockstep protocol itself (every engine call, caches by handle) is checked against one engine in
`test_lockstep_calls_match_one_engine`, with both ranks in this test's subprocesses."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

mx = pytest.importorskip("mlx.core")

from tests.server_util import REPO, Server, free_port, free_ports, start_server  # noqa: E402

LAUNCH = Path(sys.executable).parent / "mlx.launch"
if not mx.distributed.is_available() or not LAUNCH.exists():
    pytest.skip("MLX has no distributed backend or no mlx.launch here", allow_module_level=True)

FIXTURES = REPO / "tests" / "data" / "fixtures" / "arch"
LLAMA = FIXTURES / "llama3" / "tiny-llama3-F16.gguf"
QWEN3MOE = FIXTURES / "qwen3moe" / "tiny-qwen3moe-F16.gguf"
GPT_OSS = FIXTURES / "gpt-oss" / "tiny-gpt-oss-F16.gguf"
QWEN2 = FIXTURES / "qwen2" / "tiny-qwen2-F16.gguf"
GEMMA3 = FIXTURES / "gemma3" / "tiny-gemma3-F16.gguf"
PHI3_K = FIXTURES / "phi3" / "tiny-phi3-Q4_K_M.gguf"  # converted at load: each rank caches its own layers
QWEN35 = FIXTURES / "qwen35" / "tiny-qwen35-F16.gguf"  # hybrid: recurrent layers on both ranks
QWEN35MOE_K = FIXTURES / "qwen35moe" / "tiny-qwen35moe-Q4_K_M.gguf"  # quantized value heads regrouped, then split
GEMMA4 = FIXTURES / "gemma4" / "tiny-gemma4-F16.gguf"
GONE = "of the distributed group stops: a rank is gone"


class Group(Server):
    """A server started under mlx.launch: `process` is the launcher, the ranks its children."""

    def rank_pid(self, rank: int) -> int:
        """The pid of rank `rank`'s lmserve process (mlx.launch starts it under a shell)."""
        for child in psutil.Process(self.process.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if "lmserve.cli" in " ".join(child.cmdline()) and child.environ().get("MLX_RANK") == str(rank):
                    return child.pid
        raise AssertionError(f"no rank {rank} process")


@contextlib.contextmanager
def launch(model: Path, *args: str, ranks: int = 2, mode: str = "tensor", timeout: float = 120.0) -> Iterator[Group]:
    """`mlx.launch -n RANKS --backend ring -- python -m lmserve.cli MODEL --distributed MODE ARGS`,
    yielded once rank 0's /health answers. Every rank gets the same flags: only rank 0 listens."""
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="lmserve-dist-", suffix=".log", delete=False)  # noqa: SIM115
    env = {**os.environ, "XDG_CACHE_HOME": tempfile.mkdtemp(prefix="lmserve-dist-cache-")}
    proc = subprocess.Popen(
        [str(LAUNCH), "-n", str(ranks), "--backend", "ring", "--starting-port", str(free_ports(ranks)), "--",
         sys.executable, "-m", "lmserve.cli", str(model), "--distributed", mode, "--engine", "mlx",
         "--port", str(port), *args],
        stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
    group = Group(f"http://127.0.0.1:{port}", proc, log.name)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"mlx.launch exited with {proc.returncode}:\n{group.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(group.base_url + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank 0 did not become healthy:\n{group.log()}")
            time.sleep(0.1)
        yield group
    finally:
        if proc.poll() is None:
            with contextlib.suppress(AssertionError, psutil.Error):  # rank 0 stops its followers
                os.kill(group.rank_pid(0), signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        os.unlink(log.name)


def chat(base_url: str, messages: list[dict]) -> dict:
    body = {"messages": messages, "temperature": 0, "max_tokens": 8}
    r = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text  # the server's own error, not a KeyError on its body
    return r.json()


FIRST_PROMPTS = [[{"role": "user", "content": "Name three colours."}], [{"role": "user", "content": "Count to five."}]]


def conversation(base_url: str) -> list[dict]:
    """Two prompts, then a follow-up turn to the first: the replies with their usage."""
    first = FIRST_PROMPTS[0]
    replies = [chat(base_url, messages) for messages in FIRST_PROMPTS]
    follow_up = [*first, {"role": "assistant", "content": replies[0]["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "And three more?"}]
    return [*replies, chat(base_url, follow_up)]


def default_model() -> Path:
    from lmserve.model.default_model import default_model_path

    return Path(default_model_path())


# SmolLM2-135M's 9 heads and 3 KV heads split 3 ways, not 2: three tensor-parallel ranks on two
# cores take minutes (measured 143 s), so that case runs only when asked for. By layers it splits
# across 2; three ranks by layers (a middle rank both receives and sends) run on the Qwen3.5 fixture,
# hybrid layers on every rank, in a fraction of SmolLM2's 72 s.
SMOLLM2_3 = pytest.param("smollm2", 3, "tensor", id="smollm2-3-ranks", marks=pytest.mark.skipif(
    not os.environ.get("LMSERVE_TEST_SMOLLM2_3_RANKS"), reason="set LMSERVE_TEST_SMOLLM2_3_RANKS=1 to run (minutes)"))
PARALLEL = {"tensor": "tensor parallel", "pipeline": "pipeline parallel"}


@pytest.mark.parametrize(("model", "ranks", "mode"), [
    pytest.param(LLAMA, 2, "tensor", id="llama3"), pytest.param(QWEN3MOE, 2, "tensor", id="qwen3moe"),
    pytest.param(GEMMA3, 2, "pipeline", id="gemma3-pipeline"), pytest.param("smollm2", 2, "pipeline", id="smollm2-pipeline"),
    pytest.param(QWEN35, 2, "pipeline", id="qwen35-pipeline"),
    pytest.param(QWEN35, 3, "pipeline", id="qwen35-3-ranks-pipeline"), SMOLLM2_3,
])
def test_ranks_reply_as_one_process(model: Path | str, ranks: int, mode: str) -> None:
    path = default_model() if model == "smollm2" else model
    flags = ("--ctx", "512", "--batch", "2")
    with start_server(str(path), "--engine", "mlx", *flags,
                      env={"XDG_CACHE_HOME": tempfile.mkdtemp(prefix="lmserve-dist-cache-")}) as one:
        expected = conversation(one.base_url)
    with launch(path, *flags, ranks=ranks, mode=mode) as group:
        got = conversation(group.base_url)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # the first two prompts, batched
            together = list(pool.map(lambda m: chat(group.base_url, m), FIRST_PROMPTS))
        os.kill(group.rank_pid(0), signal.SIGTERM)  # a stop: rank 0 tells the followers
        group.process.wait(20)
        banner = group.log()
    assert GONE not in banner and "exited with code" not in banner, banner  # mlx.launch names non-zero exits
    assert f"distributed    {ranks} ranks, {PARALLEL[mode]}" in banner
    assert f"rank {ranks - 1} {socket.gethostname()} " in banner  # each rank's host
    assert banner.count("listening") == 1  # rank 1 opens no socket
    assert [r["choices"][0]["message"]["content"] for r in got] == \
        [r["choices"][0]["message"]["content"] for r in expected]
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (got[2], expected[2])]
    assert cached[0] == cached[1]
    # The first turn's prefix (for Qwen3.5 up to the checkpoint where its history ended: its
    # template renders the reply without this turn's empty think block).
    assert cached[0] > 0
    assert [r["choices"][0]["message"]["content"] for r in together] == \
        [r["choices"][0]["message"]["content"] for r in expected[:2]]


@pytest.mark.parametrize("mode", ["tensor", "pipeline"])
def test_killed_rank_ends_the_group_with_one_line(mode: str) -> None:
    with launch(LLAMA, "--ctx", "4096", mode=mode) as group:
        body = {"messages": [{"role": "user", "content": "Tell a long story."}], "temperature": 0,
                "max_tokens": 4000, "stream": True}
        with httpx.stream("POST", group.base_url + "/v1/chat/completions", json=body, timeout=30) as reply:
            lines = reply.iter_lines()
            for _ in range(3):
                next(line for line in lines if line.startswith("data:"))
            os.kill(group.rank_pid(1), signal.SIGKILL)
            after = []
            with contextlib.suppress(httpx.HTTPError):
                after.extend(lines)
        group.process.wait(60)  # the group ends rather than hangs (the watchdog's deadlines are seconds)
        log = group.log()
    assert GONE in log, log
    errors = [json.loads(line[5:])["error"] for line in after if line.startswith("data: {\"error\"")]
    assert errors and GONE in errors[0]["message"], (after[-3:], log)  # the stream's in-band error
    assert [line for line in after if line][-1] == "data: [DONE]"


@pytest.mark.parametrize(("model", "ranks", "mode", "refusal"), [
    (GEMMA3, 2, "tensor", "mlx-lm's gemma3 model has no tensor-parallel shard(); --distributed pipeline splits it"),
    (GEMMA4, 2, "tensor", "mlx-lm's gemma4 model has no tensor-parallel shard(); --distributed pipeline splits it"),
    ("smollm2", 2, "tensor", "this model's attention heads 9, KV heads 3 cannot be split evenly across 2 ranks"),
    (LLAMA, 3, "pipeline", "this model's 2 layers cannot be split across 3 ranks"),
], ids=["gemma3", "gemma4", "smollm2", "llama3-3-ranks"])
def test_refuses_what_cannot_be_split(model: Path | str, ranks: int, mode: str, refusal: str, tmp_path: Path) -> None:
    """Every rank refuses before loading weights (mlx.launch itself exits 0 all the same)."""
    path = default_model() if model == "smollm2" else model
    proc = subprocess.run(
        [str(LAUNCH), "-n", str(ranks), "--backend", "ring", "--starting-port", str(free_ports(ranks)), "--",
         sys.executable, "-m", "lmserve.cli", str(path), "--distributed", mode, "--port", str(free_port())],
        capture_output=True, text=True, timeout=120, cwd=REPO, env={**os.environ, "XDG_CACHE_HOME": str(tmp_path)})
    out = proc.stdout + proc.stderr
    assert out.count(refusal) == ranks, out  # one line per rank
    assert "listening" not in out


LOCKSTEP_SCRIPT = '''
import gc, json, os, sys
from pathlib import Path
import numpy as np
from lmserve.engine_mlx import MLXEngine, distributed
from lmserve.model.loader import load_model

model = load_model(Path(sys.argv[1]))
engine = distributed.load(model.gguf, model.config, sys.argv[3], os._exit)
if engine is None:  # a follower: rank 0 said STOP
    sys.exit(0)
one = MLXEngine(model.gguf, model.config)
out = {"weights": [engine.weight_bytes, one.weight_bytes], "close": [], "same_ids": [],
       "one_from": one.weights_from, "available": [engine.available_memory, [r.available for r in engine.ranks]]}

def pick(x, i):
    return x[i] if isinstance(x, tuple) else [pick(e, i) for e in x] if isinstance(x, list) else x

def both(name, *args):
    """The call on the lockstep engine and on one engine (a pair: each its own); both results."""
    return getattr(engine, name)(*pick(list(args), 0)), getattr(one, name)(*pick(list(args), 1))

def check(a, b):
    for x, y in zip(a if isinstance(a, list) else [a], b if isinstance(b, list) else [b]):
        out["close"].append(bool(np.allclose(x, y, atol=2e-3, rtol=1e-3)))
        out["same_ids"].append(bool((np.argmax(x, -1) == np.argmax(y, -1)).all()))

a = both("new_cache", 64)
check(*both("prefill", a, list(range(10, 20))))
check(*both("embed", list(range(40, 52))))  # every rank on a cache of its own: the caches held stay as they were
both("checkpoint", a)  # a hybrid cache keeps its state at 10 (a no-op for attention-only models)
b = both("new_cache", 64)
both("copy_prefix", a, b, 6)
check(*both("prefill", b, [30, 31, 32], True))
check(*both("decode", [a, b], [5, 7]))
ids = both("decode_argmax", [a, b], [3, 4])
out["argmax"] = [ids[0].tolist(), ids[1].tolist()]
check(*both("verify", [a, b], [[1, 2, 3], [4]]))
both("truncate", a, 8)
try:
    engine.prefill(a[0], [10**9])
except ValueError:
    out["refused"] = True  # the follower refused it too, and goes on
check(*both("decode", [a], [9]))
both("save_cache", a, (Path(sys.argv[2]) / "a.kv", Path(sys.argv[2]) / "one.kv"))
c = both("load_cache", (Path(sys.argv[2]) / "a.kv", Path(sys.argv[2]) / "one.kv"), 64)
check(*both("decode", [c], [2]))
del b
gc.collect()  # rank 0 dropped a cache: the followers free theirs with the next command
check(*both("decode", [c, a], [2, 2]))
out["lengths"] = [a[0].length, c[0].length]
out["rank_files"] = sorted(p.name for p in Path(sys.argv[2]).iterdir())
Path(sys.argv[2], "result.json").write_text(json.dumps(out))
'''


@pytest.mark.parametrize(("model", "mode"), [
    (LLAMA, "tensor"), (QWEN3MOE, "tensor"), (GPT_OSS, "tensor"), (QWEN2, "tensor"),
    (GEMMA3, "pipeline"), (PHI3_K, "pipeline"), (GPT_OSS, "pipeline"),
    (QWEN35, "tensor"), (QWEN35MOE_K, "tensor"), (QWEN35, "pipeline"), (GEMMA4, "pipeline"),
], ids=["llama3", "qwen3moe", "gpt-oss", "qwen2", "gemma3-pipeline", "phi3-q4k-pipeline", "gpt-oss-pipeline",
        "qwen35", "qwen35moe-q4k", "qwen35-pipeline", "gemma4-pipeline"])
def test_lockstep_calls_match_one_engine(model: Path, mode: str, tmp_path: Path) -> None:
    """Every engine call through LockstepEngine (batched decode, verify, truncate, copy_prefix, a
    refused call, save/load, a freed cache; a hybrid model's checkpoint, and the recomputation a
    cut between checkpoints makes) gives one engine's logits, with half the weights; `embed`
    gives one engine's hidden states."""
    script = tmp_path / "lockstep.py"
    script.write_text(LOCKSTEP_SCRIPT)
    proc = subprocess.run(
        [str(LAUNCH), "-n", "2", "--backend", "ring", "--starting-port", str(free_ports(2)), "--",
         sys.executable, str(script), str(model), str(tmp_path), mode],
        capture_output=True, text=True, timeout=120, cwd=REPO, env={**os.environ, "XDG_CACHE_HOME": str(tmp_path)})
    result = tmp_path / "result.json"
    assert result.exists(), proc.stdout + proc.stderr
    out = json.loads(result.read_text())
    assert all(out["close"]) and all(out["same_ids"]), out
    assert out["argmax"][0] == out["argmax"][1]
    assert out.get("refused") and out["lengths"] == [10, 11]
    assert {"a.kv", "a.kv.rank1", "one.kv"} <= set(out["rank_files"])  # each rank saves its own share
    sharded, whole = out["weights"]
    assert sharded < whole
    tightest, each = out["available"]
    assert tightest == min(each) > 0  # the RAM guard sizes slots to fit on every rank
    if model == PHI3_K:  # each rank converted and cached its own layer; the one engine read them all
        (entry,) = (tmp_path / "lmserve" / "mlx").iterdir()
        assert sorted(p.name for p in entry.iterdir()) == ["base.safetensors", "layer-0.safetensors",
                                                           "layer-1.safetensors"]
        assert out["one_from"].startswith("cache")


def test_pipeline_runs_split_layers_evenly() -> None:
    """SmolLM2's 30 layers over 4 ranks: contiguous runs, the first ranks one longer."""
    from lmserve.engine_mlx.pipeline import runs

    assert runs(30, 4) == [range(0, 8), range(8, 16), range(16, 23), range(23, 30)]
    assert runs(2, 2) == [range(0, 1), range(1, 2)]


def test_a_prompt_is_not_bounded_by_the_pace_of_decode_steps() -> None:
    """A lockstep call's deadline comes from earlier calls of its own kind: many fast decode steps
    must not leave a long prefill (hundreds of tokens, slow on a busy core) a bound of seconds."""
    from lmserve.engine_mlx.distributed.watchdog import FIRST_PACE_S, STEP_S, Pace
    from lmserve.engine_mlx.distributed.wire import Op

    class Armed:
        def arm(self, seconds: float, what: str) -> None:
            self.seconds = seconds

        def disarm(self) -> None:
            pass

    pace, armed = Pace(), Armed()
    for _ in range(3):
        pace.start(armed, Op.DECODE, 3)  # type: ignore[arg-type]
        pace.end(armed)  # type: ignore[arg-type]
    assert pace.bound(Op.DECODE, 3) < STEP_S + 1  # a decode step is fast: its bound stays near STEP_S
    pace.start(armed, Op.PREFILL, 256)  # type: ignore[arg-type]
    assert armed.seconds >= STEP_S + FIRST_PACE_S * 256  # no prefill seen yet: the generous first pace
    time.sleep(0.05)
    pace.end(armed)  # type: ignore[arg-type]
    assert pace.bound(Op.PREFILL, 256) >= STEP_S + 0.05 * 4  # then the prefill's own measured pace
