"""Prompt-lookup speculative decoding (serving/speculate.py, `Engine.verify`, the scheduler's verify
step): greedy replies are the tokens plain decoding writes, seeded sampled ones too, and grammars,
stop strings, max_tokens, logprobs, KV slots, the test proxies and /metrics keep working.

Greedy comparisons run SmolLM2 on the NumPy engine with an edit-style prompt (the model repeats a
small file), where most drafts are accepted; the MLX engine is compared step by step on a fixture.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
from pathlib import Path

import httpx
import numpy as np
import pytest

from lmserve.cli import load_draft
from lmserve.core.events import Event, Failed, Finished, TextDelta
from lmserve.core.types import ChatRequest, Message, OutputFormat, SamplingParams
from lmserve.engine.protocol import Engine
from lmserve.engine.select import load_engine
from lmserve.model.default_model import default_model_path
from lmserve.model.loader import LoadedModel, load_model
from lmserve.pool.open_model import speculation_mode
from lmserve.runtime import Runtime
from lmserve.serving import speculate
from lmserve.serving.sampling import Sampler
from lmserve.serving.speculate import PromptLookup
from lmserve.settings import Settings, UsageError, parse_settings
from tests.conftest import TINY_LLAMA
from tests.engine_proxies import FaultyEngine, Rule, Script, ScriptedEngine
from tests.fixture_models import write_model
from tests.hooked_server import Hooks
from tests.server_util import start_server

CODE = '''def area(width: float, height: float) -> float:
    return width * height


def perimeter(width: float, height: float) -> float:
    return 2 * (width + height)


def describe(width: float, height: float) -> str:
    return f"{width} x {height}: area {area(width, height)}, perimeter {perimeter(width, height)}"
'''
EDIT = f"```python\n{CODE}```\n\nRewrite this file with `describe` renamed to `summary`. Output the complete file."
STORY = "Write a short story about a lighthouse keeper."
GREEDY = SamplingParams(temperature=0, given=frozenset({"temperature"}))


def chat(text: str, sampling: SamplingParams = GREEDY, max_tokens: int = 120, **extra) -> ChatRequest:
    return ChatRequest([Message("user", text)], sampling, max_tokens, **extra)


def text_of(events: list[Event]) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta))


def finished(events: list[Event]) -> Finished:
    assert isinstance(events[-1], Finished), events[-1]
    return events[-1]


class DraftsAlwaysPay(speculate.PassCosts):
    """The cost gate pinned open: whether a draft is verified then depends on the drafter alone,
    not on how long this machine's passes took, so counts of accepted tokens are repeatable."""

    def pays(self, drafters, drafts, positions=0) -> bool:
        return True


def generate(model: LoadedModel, engine: Engine, mode: str, requests: list[ChatRequest | tuple[list[int], int]],
             ctx: int = 1024, draft: Engine | None = None, measured_gate: bool = False,
             ) -> tuple[list[list[Event]], Runtime]:
    """The requests (chats, or greedy raw prompts with their max_tokens) decoded together by a
    fresh runtime (no KV reuse between calls); its worker is stopped, its slots left as the
    requests left them. The cost gate is pinned open unless `measured_gate`."""
    runtime = Runtime(model, engine, Settings(ctx=ctx, kv_slots=len(requests), batch=len(requests),
                                                   speculate=mode), draft)
    if not measured_gate:
        runtime.scheduler.pass_costs = DraftsAlwaysPay()
    runtime.scheduler.start()  # (not runtime.start: its warm-up thread would only compete for the CPU)

    async def all_of() -> list[list[Event]]:
        async def one(request: ChatRequest | tuple[list[int], int]) -> list[Event]:
            handle = (runtime.start_chat(request) if isinstance(request, ChatRequest)
                      else runtime.start_job(request[0], GREEDY, request[1], []))
            return [event async for event in handle.events()]
        return await asyncio.gather(*(one(r) for r in requests))

    try:
        return asyncio.run(all_of()), runtime
    finally:
        runtime.stop()


@pytest.fixture(scope="module")
def smollm2() -> tuple[LoadedModel, Engine]:
    model = load_model(default_model_path())
    return model, load_engine("cpu", model.gguf, model.config)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(write_model(tmp_path_factory.mktemp("q3") / "tiny-qwen3.gguf", "qwen3"))


# -- the drafter ---------------------------------------------------------------------------------

def test_drafts_what_followed_the_latest_match_of_the_last_three_tokens() -> None:
    lookup = PromptLookup([10, 11, 12, 13, 14, 10, 11, 12, 20, 21, 22, 23])
    lookup.extend([10, 11, 12])
    assert lookup.draft(3) == [20, 21, 22]
    assert lookup.draft(2) == [20, 21]
    assert lookup.draft(0) == []


def test_of_several_matches_the_one_with_the_longest_context_drafts() -> None:
    lookup = PromptLookup([7, 8, 10, 11, 12, 30, 31, 9, 8, 10, 11, 12, 40, 41])
    lookup.extend([1, 7, 8, 10, 11, 12])  # "10 11 12" ends twice; "7 8 10 11 12" only once, first
    assert lookup.draft(2) == [30, 31]


def test_shorter_matches_are_drafted_only_while_copying() -> None:
    lookup = PromptLookup([5, 6, 7, 8, 9])
    lookup.extend([1, 7])  # only "7" occurs before: a one-token match
    assert lookup.draft(4) == []
    lookup.record(2, 2)  # a draft taken whole: the sequence is copying
    assert lookup.draft(4) == [8, 9, 1, 7]
    lookup.record(3, 1)
    assert lookup.draft(4) == []


def test_a_missed_draft_pauses_drafting_longer_each_time() -> None:
    lookup = PromptLookup([k + i for k in (0, 10, 20, 30) for i in range(1, 7)])  # 1..6, 11..16, 21..26, 31..36
    filler = iter(range(100, 1000))  # tokens that match nothing
    lookup.extend([1, 2, 3])
    assert lookup.draft(3) == [4, 5, 6]
    lookup.record(3, 0)
    for _ in range(speculate.PAUSE):  # paused for PAUSE tokens
        assert lookup.draft(3) == []
        lookup.extend([next(filler)])
    lookup.extend([11, 12, 13])
    assert lookup.draft(3) == [14, 15, 16]
    lookup.record(3, 0)  # missed again: paused twice as long
    lookup.extend([next(filler) for _ in range(speculate.PAUSE)] + [21, 22, 23])
    assert lookup.draft(3) == []
    lookup.extend([next(filler) for _ in range(speculate.PAUSE)] + [31, 32, 33])
    assert lookup.draft(3) == [34, 35, 36]
    assert (lookup.drafted, lookup.accepted) == (6, 0)


def tokens_until_drafting(lookup: PromptLookup) -> int:
    """How many tokens the sequence takes before it drafts again from a 3-token match ending them."""
    for fill in range(4 * speculate.MAX_PAUSE):
        trial = copy.deepcopy(lookup)
        trial.extend(list(range(2000, 2000 + fill)) + [41, 42, 43])
        if trial.draft(3):
            return fill + 3
    raise AssertionError("never drafts again")


def test_drafts_gaining_in_part_that_do_not_pay_back_off_as_misses_do() -> None:
    """A probe that gains a token but not its pass's cost (the cost gate then holds the next
    draft) pauses drafting twice as long each time; a draft accepted whole starts over."""
    lookup = PromptLookup([k + i for k in (0, 10, 20, 40) for i in range(1, 7)])
    filler = iter(range(100, 1000))  # tokens that match nothing
    lookup.extend([1, 2, 3])
    for start, pause in ((11, speculate.PAUSE), (21, 2 * speculate.PAUSE)):
        assert lookup.draft(3) == [start - 7, start - 6, start - 5]
        lookup.record(3, 1)
        lookup.hold()
        assert tokens_until_drafting(lookup) == pause
        lookup.extend([next(filler) for _ in range(pause - 3)] + [start, start + 1, start + 2])
    lookup.record(3, 3)  # the last draft, taken whole: copying
    lookup.record(3, 0)
    assert tokens_until_drafting(lookup) == speculate.PAUSE


def test_a_shared_pass_only_gets_a_probe_until_the_sequence_copies() -> None:
    lookup = PromptLookup(list(range(40)))
    lookup.extend([0, 1, 2])
    assert lookup.draft(10, shared=True) == [3, 4, 5][:speculate.PROBE]
    lookup.record(speculate.PROBE, speculate.PROBE)
    assert lookup.draft(10, shared=True) == list(range(3, 13))


def test_a_copying_sequence_held_by_the_cost_gate_comes_back_with_a_probe() -> None:
    """A long draft the cost gate held is not retried whole after the pause: an untimed verify
    pass of MAX_DRAFT rows (padded for every sequence of a shared pass) cost a served MoE's four
    streams twelve decode steps."""
    lookup = PromptLookup(list(range(40)))
    lookup.extend([0, 1, 2])
    assert lookup.draft(20, shared=True) == [3, 4, 5]
    lookup.record(3, 3)  # taken whole: copying
    lookup.extend([3, 4, 5])
    assert lookup.draft(20, shared=True) == list(range(6, 6 + speculate.MAX_DRAFT))
    lookup.hold()  # the cost gate: not worth its pass
    lookup.extend(list(range(6, 6 + speculate.PAUSE)))  # decoded plainly through the pause
    assert lookup.draft(20, shared=True) == list(range(14, 14 + speculate.PROBE))


def test_a_first_draft_is_a_probe_then_drafts_grow_once_one_gained() -> None:
    """A 16-row verify pass costs the NumPy engine about six decode steps: a reply with nothing
    to copy pays for short probes only."""
    lookup = PromptLookup(list(range(10, 40)) + list(range(10, 13)) + [90, 91])
    lookup.extend([20, 21, 22])
    assert lookup.draft(10) == list(range(23, 26))[:speculate.PROBE]
    lookup.record(speculate.PROBE, 1)  # gained, but not whole: no longer a first draft
    assert lookup.draft(10) == list(range(23, 33))
    lookup.record(10, 0)  # missed: paused, and the draft after the pause is a probe again
    lookup.extend(list(range(100, 100 + speculate.PAUSE)) + [10, 11, 12])
    assert lookup.draft(10) == [90, 91, 20][:speculate.PROBE]


def test_a_draft_is_verified_only_when_its_expected_gain_pays_for_the_pass() -> None:
    costs = speculate.PassCosts()
    lookup = PromptLookup(list(range(40)))
    lookup.extend([0, 1, 2])
    draft = lookup.draft(3)
    assert draft == [3, 4, 5]
    assert costs.pays([lookup], [draft]) is None  # no decode step of this batch timed yet
    costs.record(1, 1, 0.020)
    assert costs.pays([lookup], [draft]) is True  # a pass of 4 rows not timed yet: tried
    costs.record(1, 4, 0.050)  # it costs 2.5 decode steps
    assert costs.pays([lookup], [draft]) is True  # an untried drafter is expected to gain all 3
    lookup.record(3, 1)
    assert costs.pays([lookup], [draft]) is False  # 2 tokens in 2.5 steps' time
    lookup.record(3, 3)  # recent average gain 2: 3 tokens in 2.5 steps' time
    assert costs.pays([lookup], [draft]) is True
    costs.record(1, 4, 0.110)  # the pass now averages 0.065 s: 3 tokens in 3.25 steps' time
    assert costs.pays([lookup], [draft]) is False
    assert costs.pays([lookup, None], [draft, []]) is None  # a batch of 2 is another shape


def test_a_long_context_learns_its_own_pass_costs() -> None:
    """Costs learned near the start of a reply do not decide at 15,000 cached positions, where a
    verify pass over a quantized cache costs many more decode steps."""
    costs = speculate.PassCosts()
    lookup = PromptLookup(list(range(40)))
    lookup.extend([0, 1, 2])
    draft = lookup.draft(3)
    costs.record(1, 1, 0.004, positions=200)
    costs.record(1, 4, 0.006, positions=200)
    assert costs.pays([lookup], [draft], positions=200) is True
    assert costs.pays([lookup], [draft], positions=15000) is None  # a decode step there is timed first
    costs.record(1, 1, 0.036, positions=15000)
    assert costs.pays([lookup], [draft], positions=15000) is True  # its verify pass not yet tried
    costs.record(1, 4, 0.250, positions=15000)  # 7 decode steps' time for at most 4 tokens
    assert costs.pays([lookup], [draft], positions=15000) is False
    assert costs.pays([lookup], [draft], positions=16000) is False  # the same power of two
    assert costs.pays([lookup], [draft], positions=250) is True  # 128-255: the short costs


def test_an_untimed_pass_is_not_tried_where_even_a_low_estimate_of_its_cost_cannot_pay() -> None:
    """Four streams of a MoE, where each row of a pass reaches experts of its own: one stream's
    3-token probe widens the step to 16 rows. Estimated along the steps of 1-4 rows (2 ms a row),
    it costs 34 ms, and 7 tokens in that time yield less than a 10 ms step's 4: it is not tried.
    A dense model's rows cost little, and the same probe is tried; a pass timed at fewer
    positions bounds the cost of the same shape at more."""
    lookup = PromptLookup(list(range(40)))
    lookup.extend([0, 1, 2])
    drafts = [lookup.draft(3), [], [], []]
    drafters = [lookup, None, None, None]
    moe, dense = speculate.PassCosts(), speculate.PassCosts()
    for batch in range(1, 5):
        moe.record(batch, 1, 0.002 + 0.002 * batch, positions=40)
        dense.record(batch, 1, 0.0048 + 0.0002 * batch, positions=40)
    assert moe.pays(drafters, drafts, positions=40) is False
    assert dense.pays(drafters, drafts, positions=40) is True
    later = speculate.PassCosts()
    later.record(4, 1, 0.010, positions=40)
    later.record(4, 4, 0.047, positions=40)
    later.record(4, 1, 0.011, positions=100)
    assert later.pays(drafters, drafts, positions=100) is False  # 7 tokens in 47 ms or more
    later.record(4, 1, 0.011, positions=1000)
    assert later.pays(drafters, [[3, 4, 5, 6], [], [], []], positions=1000) is False  # 20 rows: no cheaper


def test_drafts_that_never_pay_leave_the_reply_as_without_speculation(smollm2, monkeypatch) -> None:
    model, engine = smollm2
    request = chat(EDIT, max_tokens=60)
    (plain,), _ = generate(model, engine, "off", [request])
    monkeypatch.setattr(speculate.PassCosts, "pays", lambda self, drafters, drafts, positions=0: False)
    (gated,), _ = generate(model, engine, "ngram", [request], measured_gate=True)
    assert text_of(gated) == text_of(plain)
    assert finished(gated).usage.drafted == 0  # every draft was held back, none verified


def test_the_acceptance_rule_keeps_the_sampling_distribution() -> None:
    """The scheduler draws from p and keeps the draft token x when the draw is x: the standard
    rule for a one-hot draft. Accepted with probability p(x); a rejection is distributed as p
    without x, renormalised."""
    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0, 1.5], dtype=np.float32)
    temperature, draft, n = 0.8, 1, 40_000
    p = np.exp(logits / temperature - (logits / temperature).max())
    p /= p.sum()
    sampler = Sampler(SamplingParams(temperature=temperature, repeat_penalty=1.0, seed=7))
    draws = np.array([sampler.sample(logits)[0] for _ in range(n)])
    accepted = draws == draft
    assert abs(accepted.mean() - p[draft]) < 4 * np.sqrt(p[draft] * (1 - p[draft]) / n)
    residual = np.delete(p, draft) / (1 - p[draft])
    seen = np.delete(np.bincount(draws[~accepted], minlength=len(p)), draft) / (~accepted).sum()
    assert np.abs(seen - residual).max() < 0.01


# -- Engine.verify ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["cpu", "mlx"])
def test_verify_gives_the_logits_of_decoding_step_by_step(kind: str) -> None:
    """Ragged lists in one pass (the short ones padded inside it), in caches an MLX decode step has
    merged into a batch; then each cache keeps a different prefix of its list and decodes on."""
    mx = pytest.importorskip("mlx.core") if kind == "mlx" else None
    model = load_model(TINY_LLAMA / "tiny-llama-F32.gguf")
    engine = load_engine(kind, model.gguf, model.config)
    assert engine.cheap_verify == (mx is None or mx.default_device().type != mx.DeviceType.cpu)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(5, model.config.vocab_size, 20 + 3 * i).tolist() for i in range(3)]
    lists = [rng.integers(5, model.config.vocab_size, n).tolist() for n in (4, 1, 6)]
    expected = []
    for prompt, ids in zip(prompts, lists, strict=True):
        cache = engine.new_cache(64)
        engine.prefill(cache, prompt)
        expected.append(np.stack([engine.decode([cache], [t])[0] for t in ids]))
    caches = [engine.new_cache(64) for _ in prompts]
    for cache, prompt in zip(caches, prompts, strict=True):
        engine.prefill(cache, prompt[:-1])
    engine.decode_argmax(caches, [p[-1] for p in prompts])
    got = engine.verify(caches, lists)
    assert [c.length for c in caches] == [len(p) + len(ids) for p, ids in zip(prompts, lists, strict=True)]
    for rows, want in zip(got, expected, strict=True):
        np.testing.assert_allclose(rows, want, atol=1e-4)
    for bad in ([caches[0], caches[0]], [[1], [2]]), (caches[:1], [[]]), (caches[:1], [[1], [2]]):
        with pytest.raises(ValueError):
            engine.verify(*bad)
    keep = [1, 1, 3]
    for cache, prompt, k in zip(caches, prompts, keep, strict=True):
        engine.truncate(cache, len(prompt) + k)
    rows = engine.decode(caches, [7, 8, 9])
    for row, prompt, ids, k, token in zip(rows, prompts, lists, keep, (7, 8, 9), strict=True):
        fresh = engine.prefill(engine.new_cache(64), prompt + ids[:k] + [token])
        np.testing.assert_allclose(row, fresh, atol=1e-4)


# -- greedy and sampled replies are those of plain decoding ------------------------------------------

def test_greedy_edit_is_written_as_without_speculation_alone_and_batched(smollm2) -> None:
    model, engine = smollm2
    (off_edit, off_story), _ = generate(model, engine, "off", [chat(EDIT), chat(STORY, max_tokens=40)])
    (on_edit, on_story), _ = generate(model, engine, "ngram", [chat(EDIT), chat(STORY, max_tokens=40)])
    (alone,), _ = generate(model, engine, "ngram", [chat(EDIT)])
    assert "def perimeter(width: float, height: float) -> float:" in text_of(off_edit)
    assert text_of(on_edit) == text_of(off_edit) == text_of(alone)
    assert text_of(on_story) == text_of(off_story)
    for events in (on_edit, alone):
        usage = finished(events).usage
        assert usage.completion_tokens == finished(off_edit).usage.completion_tokens
        assert usage.accepted > usage.completion_tokens // 3, usage  # most of the reply came from drafts
        assert usage.accepted <= usage.drafted
    assert finished(off_edit).usage.drafted == 0


def test_goldens_decode_to_their_greedy_ids(smollm2, chat_goldens: list[dict]) -> None:
    model, engine = smollm2
    replies, _ = generate(model, engine, "ngram", [(c["prompt_ids"], len(c["greedy_ids"])) for c in chat_goldens])
    for case, events in zip(chat_goldens, replies, strict=True):
        ids = [t for t in case["greedy_ids"] if t not in model.tokenizer.eog_ids]
        assert text_of(events) == model.tokenizer.decode(ids)


def test_seeded_sampling_writes_the_same_reply(smollm2) -> None:
    """Drafts are checked against the draw plain decoding makes: same seed, same reply."""
    model, engine = smollm2
    requests = [chat(EDIT, SamplingParams(temperature=0.5, seed=seed, given=frozenset({"temperature", "seed"})), 70)
                for seed in (1, 2)]
    off, _ = generate(model, engine, "off", requests)
    on, _ = generate(model, engine, "ngram", requests)
    assert [text_of(e) for e in on] == [text_of(e) for e in off]
    assert text_of(on[0]) != text_of(on[1])
    assert sum(finished(e).usage.accepted for e in on) > 0


def test_stop_strings_max_tokens_and_logprobs_see_every_token(smollm2) -> None:
    model, engine = smollm2
    logprobs = SamplingParams(temperature=0, logprobs=True, top_logprobs=2, given=frozenset({"temperature"}))
    requests = [chat(EDIT, max_tokens=37), chat(EDIT, stop=["perimeter"]), chat(EDIT, logprobs, max_tokens=50)]
    off, _ = generate(model, engine, "off", requests)
    on, _ = generate(model, engine, "ngram", requests)
    for a, b in zip(off, on, strict=True):
        assert text_of(b) == text_of(a)
        assert (finished(b).reason, finished(b).stop_sequence) == (finished(a).reason, finished(a).stop_sequence)
        assert finished(b).usage.completion_tokens == finished(a).usage.completion_tokens
        assert finished(b).usage.accepted > 0
    assert finished(on[0]).reason == "length" and finished(on[0]).usage.completion_tokens == 37
    assert finished(on[1]).stop_sequence == "perimeter" and "perimeter" not in text_of(on[1])
    lp_off = [lp for e in off[2] if isinstance(e, TextDelta) for lp in e.logprobs]
    lp_on = [lp for e in on[2] if isinstance(e, TextDelta) for lp in e.logprobs]
    assert len(lp_on) == len(lp_off) == 50
    assert [lp.token for lp in lp_on] == [lp.token for lp in lp_off]
    np.testing.assert_allclose([lp.logprob for lp in lp_on], [lp.logprob for lp in lp_off], atol=1e-3)
    assert [[t.token for t in lp.top] for lp in lp_on] == [[t.token for t in lp.top] for lp in lp_off]


def test_grammar_checks_drafts_against_its_mask(smollm2) -> None:
    model, engine = smollm2
    schema = {"type": "object", "required": ["name", "sizes"], "additionalProperties": False, "properties": {
        "name": {"type": "string"}, "sizes": {"type": "array", "items": {"type": "integer"}}}}
    record = '{"name": "rectangle", "sizes": [3, 4, 5, 6, 7, 8, 9, 10, 11, 12]}'
    request = chat(f"Repeat this JSON exactly: {record}", max_tokens=60,
                   output_format=OutputFormat("json_schema", schema, "response_format"))
    (off,), _ = generate(model, engine, "off", [request])
    (on,), _ = generate(model, engine, "ngram", [request])
    assert text_of(on) == text_of(off)
    assert set(json.loads(text_of(on))) == {"name", "sizes"}
    assert finished(on).usage.accepted > 0


def test_the_slot_holds_exactly_the_tokens_it_names(smollm2) -> None:
    """After a reply with rejected drafts the slot's cache is what a fresh prefill of its tokens
    gives, so the next turn may reuse it."""
    model, engine = smollm2
    (events,), runtime = generate(model, engine, "ngram", [chat(EDIT, max_tokens=60)])
    usage = finished(events).usage
    assert 0 < usage.accepted < usage.drafted  # some drafts were rejected
    (slot,) = runtime.slots.slots
    assert slot.cache.length == len(slot.tokens) == usage.prompt_tokens + usage.completion_tokens - 1
    probe = model.tokenizer.encode(" x", add_special=False)
    fresh = engine.prefill(engine.new_cache(1024), slot.tokens + probe)
    np.testing.assert_allclose(engine.prefill(slot.cache, probe), fresh, atol=1e-3)


# -- the test proxies force their rows inside verify passes ------------------------------------------

COPIED = "the quick brown fox jumps over the lazy dog and the quick brown fox sleeps"
SCRIPT = Script((Rule("COPY", "the quick brown fox jumps over the lazy cat and the quick brown fox sleeps"),))


@pytest.mark.parametrize("kind", ["cpu", "mlx"])
def test_scripted_engine_spells_its_reply_through_verify_passes(qwen3: LoadedModel, kind: str) -> None:
    if kind == "mlx":
        pytest.importorskip("mlx.core")
    engine = ScriptedEngine(load_engine(kind, qwen3.gguf, qwen3.config), qwen3.tokenizer, SCRIPT)
    replies, _ = generate(qwen3, engine, "ngram", [chat(f"COPY {COPIED}"), chat(f"COPY twice: {COPIED}")])
    for events in replies:
        assert text_of(events) == SCRIPT.rules[0].reply
        usage = finished(events).usage
        assert 0 < usage.accepted < usage.drafted


def test_faulty_engine_fails_the_third_token_inside_a_verify_pass(qwen3: LoadedModel) -> None:
    class Counting(FaultyEngine):
        verified = 0

        def after_verify(self, held, first, rows):
            self.verified += 1
            return super().after_verify(held, first, rows)

    # The reply's first token follows "assistant\n" in the prompt too: it is drafted from step 1.
    script = Script((Rule("FAULT", "the quick brown fox jumps"),))
    engine = Counting(ScriptedEngine(load_engine("cpu", qwen3.gguf, qwen3.config), qwen3.tokenizer, script),
                      qwen3.tokenizer.decode, "FAULT")
    (events,), _ = generate(qwen3, engine, "ngram", [chat("FAULT\nassistant\nthe quick brown fox jumps")])
    assert isinstance(events[-1], Failed) and "injected test fault" in events[-1].message
    reply = qwen3.tokenizer.encode(script.rules[0].reply, add_special=False)
    assert text_of(events) == qwen3.tokenizer.decode(reply[:2])
    assert engine.verified > 0


def test_a_failing_drafter_costs_its_sequence_the_drafts_only(qwen3: LoadedModel) -> None:
    class Broken(PromptLookup):
        def propose(self, limit: int) -> list[int]:
            raise RuntimeError("broken drafter")

    engine = ScriptedEngine(load_engine("cpu", qwen3.gguf, qwen3.config), qwen3.tokenizer, SCRIPT)
    runtime = Runtime(qwen3, engine, Settings(ctx=1024, kv_slots=1, batch=1))
    runtime.scheduler.drafters = Broken
    runtime.scheduler.start()

    async def reply() -> list[Event]:
        return [event async for event in runtime.start_chat(chat(f"COPY {COPIED}")).events()]

    try:
        events = asyncio.run(reply())
    finally:
        runtime.stop()
    assert text_of(events) == SCRIPT.rules[0].reply
    assert finished(events).usage.drafted == 0


# -- /metrics and the access log -------------------------------------------------------------------

def metric(text: str, name: str) -> float:
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def test_metrics_and_access_log_count_drafts() -> None:
    """On a server whose drafts are all verified: which are does not depend on pass timings, which
    a loaded machine (a CI runner) shifts enough that the cost gate held every draft of the edit."""
    body = {"messages": [{"role": "user", "content": EDIT}], "temperature": 0, "max_tokens": 60}
    with start_server("--engine", "cpu", hooks=Hooks(drafts_always_pay=True)) as server, \
            httpx.Client(base_url=server.base_url, timeout=120) as client:
        before = client.get("/metrics").text
        assert client.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "spec-edit"}).status_code == 200
        after = client.get("/metrics").text
        log = server.log()
    drafted = metric(after, "lmserve_draft_tokens_total") - metric(before, "lmserve_draft_tokens_total")
    accepted = (metric(after, "lmserve_draft_accepted_tokens_total")
                - metric(before, "lmserve_draft_accepted_tokens_total"))
    assert 0 < accepted <= drafted
    line = next(json.loads(entry.split("lmserve.access: ", 1)[1]) for entry in log.splitlines()
                if "lmserve.access: " in entry and "spec-edit" in entry)
    assert (line["drafted_tokens"], line["accepted_tokens"]) == (drafted, accepted)


def test_speculate_and_draft_flags(tmp_path: Path) -> None:
    small = tmp_path / "small.gguf"
    small.write_bytes(b"GGUF")

    def mode(*argv: str, cheap_verify: bool = True) -> str:
        return speculation_mode(parse_settings(list(argv), env={}), cheap_verify)

    assert (mode(), mode("--speculate", "off"), mode("--draft", str(small))) == ("ngram", "off", "draft")
    assert (mode(cheap_verify=False), mode("--speculate", "ngram", cheap_verify=False)) == ("off", "ngram")
    for contradiction in (["--speculate", "draft"], ["--draft", str(small), "--speculate", "ngram"]):
        with pytest.raises(UsageError, match="go together"):
            mode(*contradiction)
    with pytest.raises(UsageError, match="invalid choice"):
        parse_settings(["--speculate", "eagle"])


# -- a draft model -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_llama() -> LoadedModel:
    return load_model(TINY_LLAMA / "tiny-llama-F32.gguf")


def test_a_draft_model_needs_the_same_tokenizer(tiny_llama: LoadedModel, qwen3: LoadedModel) -> None:
    with pytest.raises(SystemExit, match="does not share the tokenizer"):
        load_draft(qwen3.path, tiny_llama, "cpu")
    assert load_draft(TINY_LLAMA / "tiny-llama-Q8_0.gguf", tiny_llama, "cpu").name == "cpu"


def test_the_draft_model_catches_up_then_drafts_its_greedy_continuation(tiny_llama: LoadedModel) -> None:
    engine = load_engine("cpu", tiny_llama.gguf, tiny_llama.config)
    vocab = tiny_llama.config.vocab_size
    prompt = np.random.default_rng(1).integers(5, vocab, speculate.CATCH_UP + 40).tolist()

    def greedy(tokens: list[int], n: int) -> list[int]:
        cache = engine.new_cache(1024)
        out = [int(np.argmax(engine.prefill(cache, tokens)))]
        while len(out) < n:
            out.append(int(engine.decode_argmax([cache], out[-1:])[0]))
        return out

    drafter = speculate.ModelDrafter(engine, prompt, 1024, vocab)
    assert drafter.draft(4) == []  # the first CATCH_UP prompt tokens go in first
    first = drafter.draft(4)
    assert first == greedy(prompt, speculate.PROBE)  # a first draft is a probe
    taken = [*first[:2], (first[2] + 1) % vocab]  # two accepted, then the model's own token
    drafter.extend(taken)
    drafter.record(len(first), 2)
    assert drafter.draft(4) == greedy(prompt + taken, 4)


@pytest.mark.parametrize("kind", ["cpu", "mlx"])
def test_draft_model_replies_are_plain_decoding(tiny_llama: LoadedModel, kind: str) -> None:
    """Served by the F32 fixture, drafted by its Q8_0 quantization (same tokenizer, nearly the
    same predictions), alone and batched."""
    if kind == "mlx":
        pytest.importorskip("mlx.core")
    engine = load_engine(kind, tiny_llama.gguf, tiny_llama.config)
    draft = load_draft(TINY_LLAMA / "tiny-llama-Q8_0.gguf", tiny_llama, kind)
    rng = np.random.default_rng(2)
    prompts = [(rng.integers(5, tiny_llama.config.vocab_size, n).tolist(), 40) for n in (12, 30)]
    off, _ = generate(tiny_llama, engine, "off", prompts, ctx=256)
    on, _ = generate(tiny_llama, engine, "draft", prompts, ctx=256, draft=draft)
    (alone,), _ = generate(tiny_llama, engine, "draft", prompts[:1], ctx=256, draft=draft)
    assert [text_of(e) for e in on] == [text_of(e) for e in off]
    assert text_of(alone) == text_of(off[0])
    for events in (*on, alone):
        assert finished(events).usage.completion_tokens == 40
        assert finished(events).usage.accepted > 10
