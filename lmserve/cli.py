"""`lmserve-mac [model.gguf]`: flags, model loading with progress, the banner, and uvicorn."""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import NoReturn

import psutil
import uvicorn

from lmserve import __version__
from lmserve.model.gguf_file import ModelLoadError
from lmserve.settings import Settings, UsageError, parse_settings


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
    """The listening socket, made TCP by name: asyncio turns Nagle's algorithm off only on sockets
    whose protocol says TCP, and with it on, every response after the first on a kept-alive
    connection (and every SSE frame after the first) waited 40 ms for the client's delayed ACK."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # inherited by accepted sockets on Linux
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SystemExit(f"lmserve: cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def kv_line(runtime) -> str:
    budget = runtime.slot_budget
    line = (f"{budget.slots} x up to {human_bytes(budget.per_slot)}, keys and values as {runtime.engine.kv_type} "
            f"({human_bytes(runtime.engine.kv_bytes_per_token())} a position)")
    state = runtime.engine.state_bytes()
    if state:
        line += (f" (each with up to {runtime.settings.kv_checkpoints} recurrent-state checkpoints "
                 f"of {human_bytes(state)})")
    if budget.clamped:
        line += f" (clamped from {budget.asked} by the RAM guard: see the warning above)"
    if runtime.settings.kv_cache_dir:
        line += f"; disk tier {runtime.settings.kv_cache_dir} ({runtime.settings.kv_disk_slots} files)"
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
        ("batch / queue", f"{runtime.status().max_batch} / {runtime.settings.queue}"),
        ("speculation", runtime.settings.speculate),
        ("KV slots", kv_line(runtime)),
        ("listening", f"http://{runtime.settings.host}:{runtime.settings.port}"),
        ("ready in", f"{ready_s:.2f} s"),
    ]
    if engine.quant_summary:
        rows.insert(3, ("conversion", engine.quant_summary))
    if engine.prepared:
        rows.insert(rows.index(("engine", f"{engine.name} on {engine.device}")) + 1, ("prepared", engine.prepared))
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
    """uvicorn.Server whose exit signal also stops every model's worker, so open streams end at
    once with a terminal error event instead of holding shutdown until they finish."""

    def __init__(self, config: uvicorn.Config, pool) -> None:
        super().__init__(config)
        self.pool = pool

    def handle_exit(self, sig, frame) -> None:
        logging.getLogger("lmserve").info("stopping (%s): open requests end now, new ones get 503",
                                          signal.Signals(sig).name)
        self.pool.request_stop()
        super().handle_exit(sig, frame)


def main(argv: list[str] | None = None) -> None:
    try:
        settings = parse_settings(argv)
        if settings.print_config:
            from lmserve.config_file import effective, model_file_line

            return print_out(effective(settings, model_file_line(settings)))
        if settings.list_models:
            from lmserve.model.catalog import listing

            return print_out(listing())
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        serve(settings)
    except UsageError as exc:
        print(f"lmserve: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except ModelLoadError as exc:
        if not exc.reported:  # a distributed group's ranks have each said it already
            print(f"lmserve: {exc}", file=sys.stderr)
        raise SystemExit(1) from None


def print_out(text: str) -> None:
    """Print to stdout; a reader that went away (`| head`) is no error."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit flush cannot fail too


# How long a thread holding the GIL keeps it while another waits (Python's default: 5 ms). The
# worker needs it for the Python between its kernels, and may wait that long for a thread holding
# it (the event loop's, writing tokens out); much shorter, the switches cost more than they save
# (figures: docs/PERFORMANCE.md, measurements behind code choices).
GIL_SWITCH_SECONDS = 0.001


def serve(settings: Settings) -> None:
    from functools import partial

    from lmserve.config_file import model_aliases
    from lmserve.core.duration import parse_duration
    from lmserve.engine.select import load_engine
    from lmserve.http.app import server_app
    from lmserve.http.guard import GuardOptions, is_loopback_host
    from lmserve.http.protocol import header_deadline_protocol
    from lmserve.model.default_model import default_model_path
    from lmserve.model.loader import load_model
    from lmserve.model.resolve import resolve
    from lmserve.pool.directory import ModelChoice, ModelDirectory
    from lmserve.pool.open_model import choose_context, open_runtime, speculation_mode
    from lmserve.pool.residents import ModelPool
    from lmserve.runtime import Runtime, shutting_down
    from lmserve.serving.ram_guard import MemoryRefusal

    process_start = time.time() - seconds_since_process_start()
    loopback = is_loopback_host(settings.host)
    if not loopback and not settings.api_key:
        raise UsageError(f"refusing to listen on non-loopback address {settings.host} without an API key "
                         "(pass --api-key or set LMSERVE_API_KEY)")
    path, name = resolve(settings.model) if settings.model else (default_model_path(), None)
    rank = 0
    if settings.distributed:  # the group forms first: only rank 0 listens
        from lmserve.engine_mlx import distributed

        rank = distributed.init_group().rank()
    sock = bind_socket(settings.host, settings.port) if rank == 0 else None
    model = load_model(path, name, settings.chat_template, embedded=settings.model is None)
    progress = LoadProgress("loading weights", model.gguf.file_bytes)
    if settings.distributed:
        engine = distributed.load(model.gguf, model.config, settings.distributed, exit_now, progress,
                                  settings.kv_type)
        if engine is None:  # a follower: rank 0 has stopped the group
            exit_now(0)
    else:
        engine = load_engine(settings.engine, model.gguf, model.config, progress, settings.kv_type,
                             settings.cpu_dots)
    speculate = speculation_mode(settings, engine.cheap_verify)
    draft_engine = load_draft(settings.draft, model, engine.name) if speculate == "draft" else None
    engine.checkpoints_per_cache = settings.kv_checkpoints
    context = choose_context(settings, model.config, engine)
    if warning := context_warning(context.tokens, model.config):
        logging.getLogger("lmserve.context").warning("%s", warning)
    as_given = settings  # models loaded by name get their own context and speculation
    settings = settings.with_resolved(ctx=context.tokens, speculate=speculate)
    try:
        runtime = Runtime(model, engine, settings, draft_engine)
    except MemoryRefusal as exc:
        raise SystemExit(f"lmserve: RAM guard: {exc}") from None
    except OSError as exc:
        raise SystemExit(f"lmserve: cannot use --kv-cache-dir {settings.kv_cache_dir}: {exc}") from None
    if runtime.slot_budget.warning:
        logging.getLogger("lmserve.ram").warning("RAM guard: %s", runtime.slot_budget.warning)
    runtime.start()
    directory = ModelDirectory(ModelChoice(model.model_id, model.path), model_aliases(as_given.config),
                               as_given.models_dir, default_names=(as_given.model or "",))
    pool = ModelPool(runtime, directory, partial(open_runtime, as_given), as_given.max_models,
                     parse_duration(as_given.keep_alive))
    guard = GuardOptions(api_key=settings.api_key, max_conns=settings.conns,
                         max_body=settings.max_body or default_max_body(runtime.ctx),
                         check_host=loopback, allowed_hosts=set(settings.allow_host), cors_origins=set(settings.cors),
                         read_timeout=settings.read_timeout,
                         draining=lambda: runtime.draining, shutdown_error=shutting_down)
    app = server_app(pool, guard, settings.cors)
    ready_s = time.time() - process_start
    print(banner(runtime, context.reason, ready_s), flush=True)
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=3, lifespan="off",
                            http=header_deadline_protocol(settings.read_timeout))
    server = GracefulServer(config, pool)
    sys.setswitchinterval(GIL_SWITCH_SECONDS)
    # uvicorn re-raises a caught SIGINT/SIGTERM after its graceful shutdown, under the handlers that
    # were installed before it ran; no-op handlers make a requested shutdown end with status 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        server.run(sockets=[sock])
    finally:
        pool.stop()  # --distributed: the followers exit too
    exit_now(0)


def context_warning(ctx: int, cfg) -> str | None:
    """A context past what the model was trained on, and its rope scaling stretches to, works but
    answers worse past it: say so with both numbers."""
    yarn = cfg.rope_yarn
    reach = max(cfg.context_length, int(yarn.original_context * yarn.factor) if yarn else 0)
    if ctx <= reach:
        return None
    scaling = (f"its YaRN rope scaling (factor {yarn.factor:g} over {yarn.original_context}) reaches {reach}"
               if yarn else "its file sets no rope scaling to go further")
    return (f"--ctx {ctx} is above the model's trained context of {cfg.context_length} tokens and {scaling}: "
            f"positions past {reach} are extrapolated, expect worse answers there")


def exit_now(status: int) -> NoReturn:
    """End a server process now, its output flushed, without the interpreter's finalization.
    MLX gives each thread that used it a destructor that takes the GIL; one that runs while the
    interpreter finalizes (a thread that used MLX, ending just before: the warm-up importing
    mlx-lm, an MLX worker) aborts the process with SIGABRT. Measured: 8 of 15 servers stopped by
    SIGTERM right after start, and 1 in 10 runs of a script whose one thread imports mlx_lm."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    main()
