"""Prompts that arrived together, fed in one pass (`Engine.prefill_together`, the scheduler's
`_together`): each weight is read once for all of them, and each prompt gets what it gets alone."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np
import pytest

from lmserve.core.events import Event, Failed, Finished, TextDelta
from lmserve.core.types import SamplingParams
from lmserve.engine_cpu import CPUCache, CPUEngine
from lmserve.model.loader import load_model
from lmserve.serving.jobs import EventChannel, GenerationJob
from lmserve.serving.kv_slots import SlotPool
from lmserve.serving.scheduler import Scheduler
from tests.engine_proxies import TrackingEngine
from tests.families import FAMILIES, Fixture, cosine

pytestmark = pytest.mark.fast

LENGTHS = (9, 14, 5)  # each prompt's tokens to feed; the second cache holds PREFIX more already
PREFIX = 6


def _greedy(engine: CPUEngine, caches: list[CPUCache], first: np.ndarray, steps: int) -> list[list[int]]:
    """Each cache's greedy tokens from its prompt's logits `first` `[batch, vocab]` on."""
    tokens = [[int(row.argmax())] for row in first]
    for _ in range(steps):
        rows = engine.decode(caches, [t[-1] for t in tokens])
        for t, row in zip(tokens, rows, strict=True):
            t.append(int(row.argmax()))
    return tokens


@pytest.mark.parametrize(("family", "kv_type"), [*((f, "f32") for f in FAMILIES), ("qwen3moe", "q8_0"),
                                                ("llama3", "q4_0")])
def test_prompts_fed_together_give_what_each_gives_alone(family: str, kv_type: str) -> None:
    model = load_model(Fixture(family, "Q8_0").path)
    engine = CPUEngine(model.gguf, model.config, kv_type=kv_type)
    rng = np.random.default_rng(3)
    prefix = rng.integers(10, model.config.vocab_size, PREFIX).tolist()
    prompts = [rng.integers(10, model.config.vocab_size, n).tolist() for n in LENGTHS]

    def caches() -> list[CPUCache]:
        made = [engine.new_cache(64) for _ in prompts]
        engine.prefill(made[1], prefix)
        return made

    alone_caches = caches()
    alone = np.stack([engine.prefill(c, ids) for c, ids in zip(alone_caches, prompts, strict=True)])
    together_caches = caches()
    together = engine.prefill_together(together_caches, prompts)
    assert together.shape == alone.shape
    for a, b in zip(alone, together, strict=True):
        assert cosine(a, b) > 0.9999 and a.argmax() == b.argmax()
    for a, b in zip(alone_caches, together_caches, strict=True):
        assert (a.length, list(a.tokens[:a.length])) == (b.length, list(b.tokens[:b.length]))
    assert _greedy(engine, alone_caches, alone, 4) == _greedy(engine, together_caches, together, 4)


class TogetherLog(TrackingEngine):
    """Each `prefill_together` call's list lengths; `leave` (a job) has its client leave during one."""

    def __init__(self, engine: CPUEngine) -> None:
        super().__init__(engine)
        self.together: list[list[int]] = []
        self.leave: tuple[Scheduler, GenerationJob] | None = None

    def prefill_together(self, caches: Sequence[CPUCache], token_ids: Sequence[Sequence[int]]) -> np.ndarray:
        self.together.append([len(ids) for ids in token_ids])
        if self.leave is not None:
            scheduler, job = self.leave
            scheduler.cancel(job)
        return super().prefill_together(caches, token_ids)


async def _events(job: GenerationJob) -> list[Event]:
    events = []
    while not events or not isinstance(events[-1], Finished | Failed):
        events.append(await asyncio.wait_for(job.channel.get(), 120))
    return events


def _serve(model, prompts: list[list[int]], leaving: int | None = None) -> tuple[TogetherLog, Scheduler, list[str | None]]:
    """Submit every prompt before the worker starts (they arrive together); each reply's text
    (None for the one whose client leaves during the pass, index `leaving`)."""
    engine = TogetherLog(CPUEngine(model.gguf, model.config))
    scheduler = Scheduler(engine, model.tokenizer, SlotPool(engine, len(prompts), 512), max_batch=len(prompts))
    sampling = SamplingParams(temperature=0.0, logit_bias=dict.fromkeys(model.tokenizer.eog_ids, -100.0))

    async def run() -> list[str | None]:
        jobs = [GenerationJob(ids, sampling, 12, EventChannel()) for ids in prompts]
        for job in jobs:
            scheduler.submit(job)
        if leaving is not None:
            engine.leave = (scheduler, jobs[leaving])
        scheduler.start()
        texts: list[str | None] = []
        for i, job in enumerate(jobs):
            if i == leaving:
                texts.append(None)
                continue
            events = await _events(job)
            assert isinstance(events[-1], Finished)
            texts.append("".join(e.text for e in events if isinstance(e, TextDelta)))
        for _ in range(500):  # the leaver is dropped at the worker's next loop turn
            if not scheduler.active_sequences:
                break
            await asyncio.sleep(0.01)
        return texts

    try:
        return engine, scheduler, asyncio.run(run())
    finally:
        scheduler.stop()


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return load_model(smollm2_path)


def test_prompts_that_arrive_together_share_one_pass_and_reply_as_alone(smollm2) -> None:
    rng = np.random.default_rng(5)
    prompts = [rng.integers(100, 40000, n).tolist() for n in (12, 16, 10)]
    engine, _, texts = _serve(smollm2, prompts)
    assert engine.together == [[12, 16, 10]]
    assert texts == [_serve(smollm2, [ids])[2][0] for ids in prompts]


def test_a_long_prompt_is_not_padded_for_short_ones(smollm2) -> None:
    """Padding a 10-token prompt to 200 rows would cost more than a second read of the weights."""
    rng = np.random.default_rng(6)
    engine, _, texts = _serve(smollm2, [rng.integers(100, 40000, n).tolist() for n in (10, 200, 12)])
    assert engine.together == [[10, 12]] and all(texts)


def test_a_client_that_leaves_during_the_joint_pass_gets_no_token_and_gives_its_slot_back(smollm2) -> None:
    rng = np.random.default_rng(7)
    prompts = [rng.integers(100, 40000, n).tolist() for n in (12, 16, 10)]
    engine, scheduler, texts = _serve(smollm2, prompts, leaving=1)
    assert engine.together == [[12, 16, 10]] and texts[0] and texts[2]
    assert scheduler.active_sequences == 0 and scheduler.slots.stats()["in_use"] == 0
    held = [engine.held(slot.cache) for slot in scheduler.slots.slots]
    assert sorted(len(h.tokens) for h in held)[0] == 16  # the leaver's cache holds its prompt, no token
