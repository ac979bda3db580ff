"""How the worker cuts a prompt into prefill chunks (serving/scheduler.py): at most `prefill_chunk`
tokens a loop turn while another stream decodes, since that stream's next token waits on each
chunk, and up to LONE_PREFILL_CHUNK while none does, where the NumPy engine's larger passes run
faster; a prompt's chunks evened out. On the NumPy engine, a prompt's passes are the fewest of at
most 2,048 rows (fewer where its activations would pass ACTIVATION_BUDGET), evened out, and a long
prompt's halve while their attention scores would pass SCORES_BUDGET."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np
import pytest

from lmserve.core.events import Event, Failed, Finished, TextDelta
from lmserve.core.types import SamplingParams
from lmserve.engine_cpu import CPUCache, CPUEngine
from lmserve.engine_cpu import engine as engine_module
from lmserve.model.loader import load_model
from lmserve.serving.jobs import EventChannel, GenerationJob
from lmserve.serving.kv_slots import SlotPool
from lmserve.serving.scheduler import LONE_PREFILL_CHUNK, PREFILL_CHUNK, Scheduler
from tests.engine_proxies import TrackingEngine
from tests.families import Fixture

pytestmark = pytest.mark.fast

PROMPT = 3000


class ChunkLog(TrackingEngine):
    """Each prefill call's token count, and how many other sequences were decoding then."""

    def __init__(self, engine: CPUEngine) -> None:
        super().__init__(engine)
        self.chunks: list[tuple[int, int]] = []
        self.scheduler: Scheduler | None = None

    def prefill(self, cache: CPUCache, token_ids: Sequence[int], all_logits: bool = False) -> np.ndarray:
        self.chunks.append((len(token_ids), len(self.scheduler._active)))  # noqa: SLF001  (what the chunk is beside)
        return super().prefill(cache, token_ids, all_logits)


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return load_model(smollm2_path)


def _job(ids: list[int], max_tokens: int, no_end: list[int]) -> GenerationJob:
    sampling = SamplingParams(temperature=0.0, logit_bias=dict.fromkeys(no_end, -100.0))
    return GenerationJob(ids, sampling, max_tokens, EventChannel())


async def _events(job: GenerationJob) -> list[Event]:
    events = []
    while not events or not isinstance(events[-1], Finished | Failed):
        events.append(await asyncio.wait_for(job.channel.get(), 120))
    return events


def _serve(model, prompts: list[tuple[list[int], int]]) -> tuple[ChunkLog, list[list[Event]]]:
    """Submit each (prompt, max_tokens) once the one before it has streamed its first token."""
    engine = ChunkLog(CPUEngine(model.gguf, model.config))
    scheduler = Scheduler(engine, model.tokenizer, SlotPool(engine, len(prompts), 4096), max_batch=len(prompts))
    engine.scheduler = scheduler
    no_end = list(model.tokenizer.eog_ids)

    async def run() -> list[list[Event]]:
        tasks = []
        for ids, max_tokens in prompts:
            job = _job(ids, max_tokens, no_end)
            scheduler.submit(job)
            first = []
            while not any(isinstance(e, TextDelta | Finished | Failed) for e in first):
                first.append(await asyncio.wait_for(job.channel.get(), 120))

            async def rest(job: GenerationJob = job, first: list[Event] = first) -> list[Event]:
                return first if isinstance(first[-1], Finished | Failed) else first + await _events(job)
            tasks.append(asyncio.ensure_future(rest()))
        return list(await asyncio.gather(*tasks))

    scheduler.start()
    try:
        return engine, asyncio.run(run())
    finally:
        scheduler.stop()


def test_a_lone_prompt_goes_in_larger_chunks_than_one_beside_a_decoding_stream(smollm2) -> None:
    ids = np.random.default_rng(0).integers(100, 40000, PROMPT).tolist()
    engine, replies = _serve(smollm2, [(ids[:8], 400), (ids, 2)])
    assert all(isinstance(events[-1], Finished) for events in replies)
    beside = [n for n, decoding in engine.chunks if decoding]
    alone = [n for n, decoding in engine.chunks[1:] if not decoding]  # the first prompt's one chunk aside
    assert beside and PREFILL_CHUNK // 2 < max(beside) <= PREFILL_CHUNK  # the stream waits one chunk at most
    assert alone == [] or _evened(alone, LONE_PREFILL_CHUNK)
    assert sum(n for n, _ in engine.chunks) == 8 + PROMPT

    engine, replies = _serve(smollm2, [(ids, 2)])
    assert isinstance(replies[0][-1], Finished)
    assert engine.chunks == [(PROMPT // 2, 0), (PROMPT // 2, 0)]  # not 2,048 and 952


def _evened(chunks: list[int], most: int) -> bool:
    """Whether `chunks` are the fewest of at most `most` that their sum takes, within one of each other."""
    return len(chunks) == -(-sum(chunks) // most) and max(chunks) - min(chunks) <= 1


class PassLog(CPUEngine):
    """The NumPy engine, keeping each forward pass's row count."""

    passes: list[int]

    def _forward(self, ids: np.ndarray, caches: list[CPUCache], real: list[int] | None = None) -> np.ndarray:
        self.passes.append(len(ids))
        return super()._forward(ids, caches, real)


def _passes(gguf_path, tokens: int) -> list[int]:
    model = load_model(gguf_path)
    engine = PassLog(model.gguf, model.config)
    engine.passes = []
    ids = np.random.default_rng(1).integers(100, min(model.config.vocab_size, 30000), tokens).tolist()
    engine.prefill(engine.new_cache(tokens), ids)
    return engine.passes


def test_a_prompts_passes_are_the_fewest_of_at_most_2048_rows_evened_out(smollm2_path) -> None:
    assert _passes(smollm2_path, 1100) == [1100]
    assert _passes(smollm2_path, 2500) == [1250, 1250]  # not 2,048 and 452
    assert _passes(Fixture("qwen3moe", "Q4_K_M").path, 600) == [600]


def test_a_wide_models_passes_take_fewer_rows(smollm2_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pass's widest activations stay within ACTIVATION_BUDGET: SmolLM2's FFN gate and up
    outputs (2 x 1,536 floats a row) at a budget of 600 rows' worth."""
    config = load_model(smollm2_path).config
    monkeypatch.setattr(engine_module, "ACTIVATION_BUDGET", 600 * 2 * config.ffn_size * 4)
    assert _passes(smollm2_path, 1100) == [550, 550]


def test_a_long_prompts_passes_halve_past_the_scores_budget(smollm2_path, monkeypatch: pytest.MonkeyPatch) -> None:
    heads = load_model(smollm2_path).config.n_heads
    # Scores of 512 rows fit while they see at most 512 positions: 1,100 rows halve to 550 and
    # then to 275, which fit until they see 1,100 positions; the last 275 rows take the floor,
    # LONG_PASS_ROWS, as two evened passes.
    monkeypatch.setattr(engine_module, "SCORES_BUDGET", heads * 512 * 512 * 4)
    assert _passes(smollm2_path, 1100) == [275, 275, 275, 138, 137]
