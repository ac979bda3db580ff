"""Build a model's Runtime from its file and the settings in force: what the CLI does for the
startup model and the model pool does for every model a request loads by name."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable

from lmserve.engine.protocol import Engine
from lmserve.model.config import ModelConfig
from lmserve.pool.directory import ModelChoice
from lmserve.runtime import Runtime
from lmserve.serving.ram_guard import ContextChoice, default_context, slot_state_bytes
from lmserve.serving.speculate import DEFAULT_MODE
from lmserve.settings import Settings


def speculation_mode(settings: Settings, cheap_verify: bool) -> str:
    """The `--speculate` mode: draft with `--draft`, else the default where the engine verifies
    cheaply (`Engine.cheap_verify`), else off (contradictions were refused with the settings)."""
    return settings.speculate or ("draft" if settings.draft else DEFAULT_MODE if cheap_verify else "off")


def choose_context(settings: Settings, config: ModelConfig, engine: Engine) -> ContextChoice:
    """`--ctx` (or the model's own `ctx`), else the RAM guard's default for this model."""
    if settings.ctx:
        return ContextChoice(settings.ctx, "--ctx")
    return default_context(config.context_length, engine.kv_bytes_per_token(), engine.available_memory,
                           slot_state_bytes(engine))


def model_settings(settings: Settings, choice: ModelChoice) -> Settings:
    """The server's settings with a model's own (a config-file alias's) over them, for a model
    loaded by name: it never drafts (`--draft` pairs with the startup model's tokenizer), and its
    disk-tier files live in a folder of its own (each tier keeps its newest `--kv-disk-slots`)."""
    own = dataclasses.replace(settings, **choice.overrides)
    folder = None
    if own.kv_cache_dir is not None:
        folder = own.kv_cache_dir / f"model-{hashlib.sha256(choice.key.encode()).hexdigest()[:16]}"
    return dataclasses.replace(own, draft=None, speculate=None if own.speculate == "draft" else own.speculate,
                               kv_cache_dir=folder)


def open_runtime(settings: Settings, choice: ModelChoice,
                 progress: Callable[[int, int], None] | None = None) -> Runtime:
    """Load `choice` and start its Runtime (ModelLoadError, MemoryRefusal when it cannot)."""
    from lmserve.engine.select import load_engine
    from lmserve.model.loader import load_model

    settings = model_settings(settings, choice)
    model = load_model(choice.path, choice.name, settings.chat_template)
    try:
        engine = load_engine(settings.engine, model.gguf, model.config, progress, settings.kv_type,
                             settings.cpu_dots)
        engine.checkpoints_per_cache = settings.kv_checkpoints
        context = choose_context(settings, model.config, engine)
        runtime = Runtime(model, engine, settings.with_resolved(
            ctx=context.tokens, speculate=speculation_mode(settings, engine.cheap_verify)))
    except BaseException:
        model.gguf.close()
        raise
    runtime.start()
    return runtime
