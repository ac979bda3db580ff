"""`lmserve-mac [model.gguf]`: flags, model loading with progress, the banner, and uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

import psutil
import uvicorn

from lmserve import __version__
from lmserve.config_file import parse_args_with_config
from lmserve.model.gguf_file import ModelLoadError
from lmserve.serving.scheduler import PREFILL_CHUNK
from lmserve.serving.speculate import DEFAULT_MODE, MODES


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lmserve-mac", description=(
        "Serve one GGUF model behind the OpenAI Chat Completions, OpenAI Responses and Anthropic "
        "Messages APIs. Without a model, serves the embedded SmolLM2-135M-Instruct."))
    p.add_argument("model", nargs="?",
                   help="path to a .gguf file, or the name of a model in Ollama, LM Studio, the Hugging Face cache "
                        "or llama.cpp's cache (see --list; default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port to listen on (default 8080)")
    p.add_argument("--ctx", type=int, default=None,
                   help="context size in tokens (default: the model's trained context when one full KV slot "
                        "of it fits in memory, else the largest multiple of 4096 that fits)")
    p.add_argument("--engine", choices=("auto", "cpu", "mlx"), default="auto",
                   help="auto: MLX when it has a GPU, else the NumPy engine")
    p.add_argument("--distributed", nargs="?", const="tensor", choices=("tensor", "pipeline"), default=None,
                   help="shard the model across the ranks mlx.launch starts: tensor (the default) or pipeline parallel "
                        "(see docs/DISTRIBUTED.md)")
    p.add_argument("--queue", type=int, default=16, help="requests that may wait for the worker (default 16)")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together (default 1)")
    p.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK, metavar="N",
                   help=f"prompt tokens prefilled between two decode steps of the running streams "
                        f"(default {PREFILL_CHUNK}; 0: whole prompts at once)")
    p.add_argument("--speculate", choices=MODES, default=None,
                   help=f"speculative decoding, the reply unchanged: ngram drafts from the prompt and reply so far, "
                        f"draft from the --draft model; off decodes one token per step "
                        f"(default {DEFAULT_MODE}, or draft with --draft)")
    p.add_argument("--draft", type=Path, default=None, metavar="GGUF",
                   help="a small model with the same tokenizer that drafts tokens for the served one to verify")
    p.add_argument("--max-tokens", type=int, default=None, metavar="N",
                   help="reply budget of a request that sets none (default: the rest of the context)")
    p.add_argument("--reasoning-budget", type=int, default=-1, metavar="N",
                   help="tokens a reply may reason when its request sets no budget (default -1: no budget of "
                        "its own, at most 3/4 of the reply; 0: reasoning off)")
    p.add_argument("--temp", type=float, default=None, metavar="T",
                   help="temperature of a request that sets none (default: the model's recommended one)")
    p.add_argument("--sse-keepalive", type=float, default=5.0, metavar="SECONDS",
                   help="a stream silent this long (queued, long prefill) gets a ping or SSE comment (default 5)")
    p.add_argument("--kv-slots", type=int, default=4,
                   help="resident KV caches reused across requests (default 4, at least --batch)")
    p.add_argument("--kv-slots-force", action="store_true",
                   help="keep --kv-slots even when the RAM guard finds they do not fit")
    p.add_argument("--no-kv-reuse", dest="kv_reuse", action="store_false",
                   help="prefill every prompt whole, reusing no cached prefix (to measure what reuse saves)")
    p.add_argument("--kv-cache-dir", type=Path, default=None,
                   help="spill evicted KV slots to files here; they survive restarts (off by default)")
    p.add_argument("--kv-disk-slots", type=int, default=8, help="KV cache files kept on disk (default 8)")
    p.add_argument("--kv-checkpoints", type=int, default=8, metavar="N",
                   help="hybrid models (Qwen3.5 / 3.6): recurrent-state checkpoints each KV slot keeps, the "
                        "prefixes it can resume from (default 8; each costs one recurrent state)")
    p.add_argument("--conns", type=int, default=32, help="concurrent connections; beyond, 503 (default 32)")
    p.add_argument("--api-key", default=os.environ.get("LMSERVE_API_KEY"),
                   help="require this key (Authorization: Bearer or x-api-key); env LMSERVE_API_KEY")
    p.add_argument("--allow-host", action="append", default=[], metavar="HOST",
                   help="accept this Host header on a loopback bind (repeatable)")
    p.add_argument("--max-body", type=int, default=None,
                   help="largest request body in bytes; beyond, 413 (default: sized for the context)")
    p.add_argument("--cors", action="append", default=[], metavar="ORIGIN",
                   help="allow cross-origin requests from ORIGIN (repeatable; off by default)")
    p.add_argument("--chat-template", type=Path, default=None, metavar="FILE",
                   help="a Jinja chat template to use instead of the one in the GGUF")
    p.add_argument("--config", type=Path, default=None, metavar="FILE",
                   help="read flags from this TOML file (default: $XDG_CONFIG_HOME/lmserve/config.toml or "
                        "~/.config/lmserve/config.toml, when it exists); the command line wins")
    p.add_argument("--list", action="store_true",
                   help="list the models in Ollama, LM Studio, the Hugging Face cache and llama.cpp's cache, and exit")
    p.add_argument("--print-config", action="store_true",
                   help="print the settings in force (config file and command line) and exit")
    p.add_argument("--version", action="version", version=f"lmserve {__version__}")
    return parse_args_with_config(p, argv)


class LoadProgress:
    """One progress bar with bytes, rate and time left on a terminal; a few plain lines otherwise
    (logs, services). Engines count tensors: layers are alike, so the share of tensors done times
    the file's bytes is close to the bytes read, and that is what is shown."""

    def __init__(self, label: str, total_bytes: int) -> None:
        self.label = label
        self.total_bytes = max(1, total_bytes)
        self.started = time.monotonic()
        self._bar = None
        self._last_quarter = -1

    def __call__(self, done: int, total: int) -> None:
        done_bytes = self.total_bytes * done // total if total else self.total_bytes
        if sys.stderr.isatty():
            self._draw(done_bytes)
        elif done_bytes * 4 // self.total_bytes > self._last_quarter:
            self._last_quarter = done_bytes * 4 // self.total_bytes
            rate = done_bytes / max(time.monotonic() - self.started, 1e-6)
            left = f", {(self.total_bytes - done_bytes) / rate:.0f} s left" if 0 < done_bytes < self.total_bytes else ""
            print(f"{self.label}: {100 * done_bytes // self.total_bytes}% ({human_bytes(done_bytes)} of "
                  f"{human_bytes(self.total_bytes)}, {human_bytes(rate)}/s{left})", file=sys.stderr, flush=True)

    def _draw(self, done_bytes: int) -> None:
        if self._bar is None:  # rich is imported only for a terminal (Litestar depends on it)
            from rich import progress
            from rich.console import Console

            self._bar = progress.Progress(
                "{task.description}", progress.BarColumn(), progress.DownloadColumn(binary_units=True),
                progress.TransferSpeedColumn(), progress.TimeRemainingColumn(), console=Console(stderr=True))
            self._task = self._bar.add_task(self.label, total=self.total_bytes)
            self._bar.start()
        self._bar.update(self._task, completed=done_bytes)
        if done_bytes >= self.total_bytes:
            self._bar.stop()


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SystemExit(f"lmserve: cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def kv_line(runtime) -> str:
    budget = runtime.slot_budget
    line = f"{budget.slots} x up to {human_bytes(budget.per_slot)}"
    state = runtime.engine.state_bytes()
    if state:
        line += (f" (each with up to {runtime.options.kv_checkpoints} recurrent-state checkpoints "
                 f"of {human_bytes(state)})")
    if budget.clamped:
        line += f" (clamped from {budget.asked} by the RAM guard: see the warning above)"
    if runtime.options.kv_cache_dir:
        line += f"; disk tier {runtime.options.kv_cache_dir} ({runtime.options.kv_disk_slots} files)"
    return line


def family_line(cfg) -> str:
    """"Qwen3 MoE (qwen3moe), 48 layers, 30.5B parameters, 3.3B active per token (8 of 128 experts)"."""
    line = f"{cfg.family} ({cfg.architecture}), {cfg.n_layers} layers, {human_count(cfg.n_params)} parameters"
    if cfg.is_moe:
        line += (f", {human_count(cfg.n_active_params)} active per token "
                 f"({cfg.n_experts_used} of {cfg.n_experts} experts)")
    return line


def human_count(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def banner(runtime, context_reason: str, ready_s: float) -> str:
    cfg = runtime.model.config
    engine = runtime.engine
    mix = ", ".join(f"{k} x{v}" for k, v in cfg.quant_mix.items())
    rows = [
        ("model", f"{runtime.model.model_id} ({runtime.model.path})"),
        ("family", family_line(cfg)),
        ("chat template", runtime.model.template_origin),
        ("quant mix", mix),
        ("engine", f"{engine.name} on {engine.device}"),
        ("context", f"{runtime.ctx} tokens ({context_reason})"),
        ("sampling", f"defaults {runtime.sampling_defaults.describe()}"),
        ("weights", human_bytes(engine.weight_bytes)),
        ("batch / queue", f"{runtime.status().max_batch} / {runtime.options.max_queue}"),
        ("speculation", runtime.options.speculate),
        ("KV slots", kv_line(runtime)),
        ("listening", f"http://{runtime.options.host}:{runtime.options.port}"),
        ("ready in", f"{ready_s:.2f} s"),
    ]
    if engine.quant_summary:
        rows.insert(3, ("conversion", engine.quant_summary))
    if engine.ranks:  # --distributed: each rank's share of the weights, and its free memory
        shares = ", ".join(f"rank {r} {rank.host} {human_bytes(rank.weight_bytes)} ({human_bytes(rank.available)} free)"
                           for r, rank in enumerate(engine.ranks))
        rows.insert(rows.index(("weights", human_bytes(engine.weight_bytes))) + 1,
                    ("distributed", f"{len(engine.ranks)} ranks, {engine.parallelism}; weights {shares}"))
    width = max(len(k) for k, _ in rows)
    return "\n".join([f"lmserve {__version__}"] + [f"  {k:<{width}}  {v}" for k, v in rows])


def seconds_since_process_start() -> float:
    """How long this process has run. On Linux from /proc in clock ticks (psutil's create_time
    adds a boot time rounded to whole seconds, up to a second off); elsewhere psutil's figure."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return max(0.0, time.time() - psutil.Process().create_time())


def default_max_body(ctx: int) -> int:
    """Room for a full context of text with JSON overhead and tool schemas, at least 4 MiB."""
    return max(4 * 1024 * 1024, ctx * 64)


def check_speculation(args: argparse.Namespace, cheap_verify: bool) -> str:
    """The `--speculate` mode: draft with `--draft`, else the default where the engine verifies
    cheaply (`Engine.cheap_verify`), else off; contradictions refused."""
    mode = args.speculate or ("draft" if args.draft else DEFAULT_MODE if cheap_verify else "off")
    if (mode == "draft") != (args.draft is not None):
        raise SystemExit("lmserve: --speculate draft and --draft go together (--draft alone implies it)")
    return mode


def load_draft(path: Path, model, kind: str):
    """The draft model on the served model's engine kind; refused unless its tokenizer gives every
    id the served model's bytes (its drafts would be other tokens)."""
    from lmserve.engine.select import load_engine
    from lmserve.model.loader import load_model
    from lmserve.serving.speculate import same_vocabulary

    draft = load_model(path)
    if not same_vocabulary(model.tokenizer, draft.tokenizer):
        raise SystemExit(f"lmserve: --draft {path} does not share the tokenizer of {model.path.name} "
                         f"({draft.tokenizer.vocab_size} tokens against {model.tokenizer.vocab_size}, or other "
                         "tokens): a draft model must use the same one")
    return load_engine(kind, draft.gguf, draft.config, LoadProgress("loading draft weights", draft.gguf.file_bytes))


class GracefulServer(uvicorn.Server):
    """uvicorn.Server whose exit signal also stops the worker, so open streams end at once with a
    terminal error event instead of holding shutdown until they finish."""

    def __init__(self, config: uvicorn.Config, runtime) -> None:
        super().__init__(config)
        self.runtime = runtime

    def handle_exit(self, sig, frame) -> None:
        self.runtime.request_stop()
        super().handle_exit(sig, frame)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.list:
        from lmserve.model.catalog import listing

        print(listing())
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        serve(args)
    except ModelLoadError as exc:
        raise SystemExit(f"lmserve: {exc}") from None


def serve(args: argparse.Namespace) -> None:
    from lmserve.engine.select import load_engine
    from lmserve.http.app import server_app
    from lmserve.http.guard import GuardOptions, is_loopback_host
    from lmserve.model.default_model import default_model_path
    from lmserve.model.loader import load_model
    from lmserve.model.resolve import resolve
    from lmserve.runtime import Runtime, ServerOptions, shutting_down
    from lmserve.serving.ram_guard import ContextChoice, default_context, slot_state_bytes

    process_start = time.time() - seconds_since_process_start()
    loopback = is_loopback_host(args.host)
    if not loopback and not args.api_key:
        raise SystemExit(f"lmserve: refusing to listen on non-loopback address {args.host} without an API key "
                         "(pass --api-key or set LMSERVE_API_KEY)")
    # flags alone, checked before anything is resolved or loaded
    if args.ctx is not None and args.ctx < 16:
        raise SystemExit(f"lmserve: --ctx {args.ctx} is too small (at least 16)")
    if args.temp is not None and not 0 <= args.temp <= 2:
        raise SystemExit(f"lmserve: --temp {args.temp} is outside 0..2")
    if args.kv_checkpoints < 1:
        raise SystemExit("lmserve: --kv-checkpoints must be at least 1")
    if args.reasoning_budget < -1:
        raise SystemExit("lmserve: --reasoning-budget must be -1 (no budget), 0 (off) or a token count")
    if args.prefill_chunk < 0 or args.sse_keepalive <= 0 or (args.max_tokens is not None and args.max_tokens < 1):
        raise SystemExit("lmserve: --prefill-chunk must be 0 or more, --sse-keepalive more than 0, "
                         "--max-tokens at least 1")
    path, name = resolve(args.model) if args.model else (default_model_path(), None)
    rank = 0
    if args.distributed:  # the group forms first: only rank 0 listens
        from lmserve.engine_mlx import distributed

        rank = distributed.check_args(args)
    sock = bind_socket(args.host, args.port) if rank == 0 else None
    model = load_model(path, name, args.chat_template)
    progress = LoadProgress("loading weights", model.gguf.file_bytes)
    if args.distributed:
        engine = distributed.load(model.gguf, model.config, args.distributed, progress)
        if engine is None:  # a follower: rank 0 has stopped the group
            exit_without_finalizing()
    else:
        engine = load_engine(args.engine, model.gguf, model.config, progress)
    speculate = check_speculation(args, engine.cheap_verify)
    draft_engine = load_draft(args.draft, model, engine.name) if speculate == "draft" else None
    engine.checkpoints_per_cache = args.kv_checkpoints
    context = ContextChoice(args.ctx, "--ctx") if args.ctx else default_context(
        model.config.context_length, engine.kv_bytes_per_token(), engine.available_memory,
        slot_state_bytes(engine))
    ctx = context.tokens
    options = ServerOptions(host=args.host, port=args.port, ctx=ctx, max_queue=args.queue,
                            max_batch=args.batch, api_key=args.api_key, kv_slots=args.kv_slots,
                            kv_slots_force=args.kv_slots_force, kv_reuse=args.kv_reuse, kv_cache_dir=args.kv_cache_dir,
                            kv_disk_slots=args.kv_disk_slots, kv_checkpoints=args.kv_checkpoints,
                            prefill_chunk=args.prefill_chunk,
                            keepalive=args.sse_keepalive, max_tokens=args.max_tokens, speculate=speculate,
                            temperature=args.temp, reasoning_budget=args.reasoning_budget)
    try:
        runtime = Runtime(model, engine, options, draft_engine)
    except OSError as exc:
        raise SystemExit(f"lmserve: cannot use --kv-cache-dir {args.kv_cache_dir}: {exc}") from None
    if runtime.slot_budget.warning:
        logging.getLogger("lmserve.ram").warning("RAM guard: %s", runtime.slot_budget.warning)
    runtime.start()
    guard = GuardOptions(api_key=args.api_key, max_conns=args.conns,
                         max_body=args.max_body or default_max_body(ctx),
                         check_host=loopback, allowed_hosts=set(args.allow_host),
                         draining=lambda: runtime.draining, shutdown_error=shutting_down)
    app = server_app(runtime, guard, args.cors)
    ready_s = time.time() - process_start
    print(banner(runtime, context.reason, ready_s), flush=True)
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=3, lifespan="off")
    server = GracefulServer(config, runtime)
    # uvicorn re-raises a caught SIGINT/SIGTERM after its graceful shutdown, under the handlers that
    # were installed before it ran; no-op handlers make a requested shutdown end with status 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        server.run(sockets=[sock])
    finally:
        runtime.stop()  # --distributed: the followers exit too
    exit_without_finalizing()


def exit_without_finalizing() -> None:
    """End a server process with status 0 now, its output flushed, without the interpreter's
    finalization. MLX gives each thread that used it a destructor that takes the GIL; one that
    runs while the interpreter finalizes (a thread that used MLX, ending just before: the warm-up
    importing mlx-lm, an MLX worker) aborts the process with SIGABRT. Measured: 8 of 15 servers
    stopped by SIGTERM right after start, and 1 in 10 runs of a script whose one thread imports
    mlx_lm."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
