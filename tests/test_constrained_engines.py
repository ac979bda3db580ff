"""Grammar masks apply on every decode step of both engines (the MLX engine's device-argmax fast
path steps aside for them), through the real runtime and scheduler, on the random-weight tiny
Qwen3 fixture: unconstrained it writes noise, constrained it can only write what the grammar allows."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import jsonschema
import pytest

from lmserve.core.events import Event, Finished, TextDelta, ToolCallEvent
from lmserve.core.types import ChatRequest, Message, OutputFormat, SamplingParams, Tool, ToolChoice
from lmserve.engine.select import load_engine
from lmserve.model.loader import load_model
from lmserve.runtime import Runtime
from lmserve.settings import Settings
from tests.fixture_models import write_model

pytestmark = pytest.mark.fast  # in-process: part of `scripts/test.sh -m fast`

PATTERN = "(ab|ba){2,4}!"
CITY = {"type": "object", "required": ["city"], "additionalProperties": False,
        "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,6}$"}}}


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("q3") / "tiny-qwen3.gguf", "qwen3")


async def generate(runtime: Runtime, request: ChatRequest) -> list[Event]:
    job = runtime.start_chat(request)
    return [event async for event in job.events()]


@pytest.mark.parametrize("kind", ["cpu", "mlx"])
def test_grammar_and_forced_call_on_both_engines(qwen3_path: Path, kind: str) -> None:
    if kind == "mlx":
        pytest.importorskip("mlx.core")
    model = load_model(qwen3_path)
    runtime = Runtime(model, load_engine(kind, model.gguf, model.config),
                      Settings(ctx=1024, kv_slots=2, batch=2))
    runtime.start()
    greedy = SamplingParams(temperature=0)
    user = [Message("user", "hi")]
    regex = ChatRequest(user, greedy, 24, output_format=OutputFormat("regex", PATTERN, "regex"))
    call = ChatRequest(user, greedy, 80, tools=[Tool("get_weather", None, CITY, strict=True)],
                       tool_choice=ToolChoice("required"))
    free = ChatRequest(user, greedy, 12)

    async def both() -> list[list[Event]]:  # batched together, constrained and free side by side
        return await asyncio.gather(*(generate(runtime, r) for r in (regex, call, free)))

    try:
        regex_events, call_events, free_events = asyncio.run(both())
    finally:
        runtime.stop()
    text = "".join(e.text for e in regex_events if isinstance(e, TextDelta))
    assert re.fullmatch(PATTERN, text), text
    assert regex_events[-1] == Finished("stop", regex_events[-1].usage)
    (tool_call,) = [e for e in call_events if isinstance(e, ToolCallEvent)]
    jsonschema.validate(json.loads(tool_call.arguments), CITY)
    assert call_events[-1].reason == "tool_calls"
    free_text = "".join(e.text for e in free_events if isinstance(e, TextDelta))
    assert not re.fullmatch(PATTERN, free_text)  # the fixture really does write noise
