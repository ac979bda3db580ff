"""Legacy OpenAI text completions (`POST /v1/completions`): raw prompts, no chat template."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from lmserve.core.errors import invalid
from lmserve.core.events import Event, Failed, Finished, KeepAlive, TextDelta, TokenLogprob, Usage
from lmserve.core.types import OutputFormat, SamplingParams
from lmserve.http.chat_schema import CompletionsBody
from lmserve.http.common import KEEPALIVE_COMMENT, sse
from lmserve.http.openai_chat import usage_json
from lmserve.http.request_fields import response_format, sampling_params, stop_strings
from lmserve.http.structs import decode
from lmserve.model.tokenizer import Tokenizer


@dataclass
class CompletionCall:
    prompts: list[list[int]]
    sampling: SamplingParams
    max_tokens: int | None
    stop: list[str]
    stream: bool
    include_usage: bool
    output_format: OutputFormat | None = None  # response_format or a grammar extension, as on chat


def parse_prompts(value: str | list[Any], tokenizer: Tokenizer) -> list[list[int]]:
    """A string, a list of strings, a list of token ids, or a list of such lists."""
    def ids(item: Any, where: str) -> list[int]:
        if isinstance(item, str):
            return tokenizer.encode(item, add_special=True, parse_special=True)
        if isinstance(item, list) and item and all(isinstance(t, int) for t in item):
            if not all(t < tokenizer.vocab_size for t in item):
                raise invalid(where, f"token ids must be between 0 and {tokenizer.vocab_size - 1}")
            return list(item)
        raise invalid(where, "must be a string, an array of strings, or an array of token ids")

    if value and isinstance(value, list) and all(isinstance(p, str | list) for p in value):
        return [ids(p, f"prompt[{i}]") for i, p in enumerate(value)]
    return [ids(value, "prompt")]


def parse_completion(raw: dict[str, Any], tokenizer: Tokenizer) -> CompletionCall:
    body = decode(raw, CompletionsBody)
    prompts = parse_prompts(body.prompt, tokenizer)
    if body.echo:
        raise invalid("echo", "echoing the prompt is not supported")
    if body.suffix is not None:
        raise invalid("suffix", "insertion (suffix) is not supported")
    if body.n not in (None, 1) or body.best_of not in (None, 1):
        raise invalid("n", "only n=1 (and best_of=1) is supported")
    sampling = sampling_params(body, tokenizer.vocab_size)
    sampling.logprobs, sampling.top_logprobs = body.logprobs is not None, body.logprobs or 0
    include_usage = body.stream_options is not None and body.stream_options.include_usage is True
    return CompletionCall(prompts, sampling, body.max_tokens, stop_strings(body.stop),
                          body.stream is True, include_usage, response_format(body, body.response_format))


def legacy_logprobs(lps: list[TokenLogprob], offset: int) -> dict[str, Any]:
    """The completions API's column-wise logprobs shape."""
    offsets, at = [], offset
    for lp in lps:
        offsets.append(at)
        at += len(lp.token)
    return {"tokens": [lp.token for lp in lps], "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{t.token: t.logprob for t in lp.top} for lp in lps], "text_offset": offsets}


class CompletionRenderer:
    """Events of one job per prompt -> text_completion bodies or chunks (choice index = prompt index)."""

    def __init__(self, model: str, logprobs: bool, include_usage: bool) -> None:
        self.id = f"cmpl-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.model = model
        self.logprobs = logprobs
        self.include_usage = include_usage

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices}

    def body(self, per_prompt: list[list[Event]]) -> dict[str, Any]:
        choices, totals = [], [0, 0, 0]
        for index, events in enumerate(per_prompt):
            deltas = [e for e in events if isinstance(e, TextDelta)]
            finish = next(e for e in events if isinstance(e, Finished))
            lps = [lp for d in deltas for lp in d.logprobs]
            choices.append({"text": "".join(d.text for d in deltas), "index": index,
                            "logprobs": legacy_logprobs(lps, 0) if self.logprobs else None,
                            "finish_reason": finish.reason})
            for i, n in enumerate((finish.usage.prompt_tokens, finish.usage.completion_tokens,
                                   finish.usage.cached_tokens)):
                totals[i] += n
        return {**self._envelope(choices), "usage": usage_json(Usage(*totals))}

    async def frames(self, per_prompt: list[AsyncIterator[Event]]) -> AsyncIterator[bytes]:
        totals = [0, 0, 0]
        for index, events in enumerate(per_prompt):
            offset = 0
            async for event in events:
                if isinstance(event, TextDelta):
                    lp = legacy_logprobs(event.logprobs, offset) if self.logprobs else None
                    offset += len(event.text)
                    yield sse(self._envelope([{"text": event.text, "index": index, "logprobs": lp,
                                               "finish_reason": None}]))
                elif isinstance(event, Finished):
                    yield sse(self._envelope([{"text": "", "index": index, "logprobs": None,
                                               "finish_reason": event.reason}]))
                    for i, n in enumerate((event.usage.prompt_tokens, event.usage.completion_tokens,
                                           event.usage.cached_tokens)):
                        totals[i] += n
                elif isinstance(event, KeepAlive):
                    yield KEEPALIVE_COMMENT
                elif isinstance(event, Failed):
                    yield sse({"error": {"message": event.message, "type": event.error_type,
                                         "param": None, "code": None}})
                    yield b"data: [DONE]\n\n"
                    return
        if self.include_usage:
            yield sse({**self._envelope([]), "usage": usage_json(Usage(*totals))})
        yield b"data: [DONE]\n\n"

