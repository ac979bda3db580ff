"""What the forced-call grammars cost, in each family's call format, on SmolLM2 and the NumPy engine.

Per token: a forced call decoded greedily under the family's grammar (bitmask, -inf fill and
consume, timed apart from the engine's decode step), for one small tool and for Claude Code's 24
tools (their `input_schema`s, strict and lenient as the Anthropic adapter offers them); the target
is under 10% of a decode step. Per request: the planner building and compiling each family's
forced-call grammar for Claude Code's tools, cold (the first request with them) and cached (every
request after; the source is rebuilt and found in the cache). The formats come from the families'
real chat templates; SmolLM2 lacks their special tokens, so the markers are spelled out.

    python scripts/bench_grammar.py [--model PATH] [--steps N]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from lmserve.chat.grammar import Grammars
from lmserve.chat.planner import ReplyPlanner
from lmserve.core.types import ChatRequest, Message, Tool, ToolChoice
from lmserve.engine.protocol import Engine
from lmserve.engine.select import load_engine
from lmserve.model.chat_template import ChatTemplate
from lmserve.model.config import ModelConfig
from lmserve.model.default_model import default_model_path
from lmserve.model.gguf_file import GGUFFile
from lmserve.model.tokenizer import Tokenizer

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"
TEMPLATES = {"hermes (Qwen2.5, Qwen3)": "qwen2.5.jinja", "Qwen3-Coder XML": "qwen3-coder.jinja",
             "Mistral / Devstral": "devstral.jinja", "Llama 3.1 JSON": "llama-3.1.jinja", "gpt-oss harmony": "gpt-oss.jinja"}
WEATHER = Tool("get_weather", "Current weather in a city", {
    "type": "object", "additionalProperties": False, "required": ["city", "unit"], "properties": {
        "city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}}}, strict=True)
PROMPT = "<|im_start|>user\nWhat is the weather in Paris right now?<|im_end|>\n<|im_start|>assistant\n"


def claude_code_tools() -> list[Tool]:
    body = json.loads((DATA / "clients" / "claude-code-2.1.197-messages-with-tools.json").read_text())["body"]
    return [Tool(t["name"], t.get("description"), t["input_schema"], strict=True, lenient=True) for t in body["tools"]]


def forced(tools: list[Tool]) -> ChatRequest:
    return ChatRequest([Message("user", "x")], tools=tools, tool_choice=ToolChoice("required"))


def per_token(engine: Engine, tokenizer: Tokenizer, planner: ReplyPlanner, tools: list[Tool],
              steps: int) -> tuple[float, float, int]:
    """Seconds of grammar and of decode per token (medians: neighbours on the machine make the
    mean jump) over a greedy forced call of at most `steps` tokens."""
    grammar = planner.plan(forced(tools), "").grammar
    assert grammar is not None
    constraint = grammar.constraint()
    assert constraint is not None
    prompt = tokenizer.encode(PROMPT, add_special=False, parse_special=True)
    cache = engine.new_cache(len(prompt) + steps + 1)
    logits = engine.prefill(cache, prompt)
    grammar_s: list[float] = []
    decode_s: list[float] = []
    while len(decode_s) < steps and not constraint.finished:
        start = time.perf_counter()
        token = int(np.argmax(constraint.mask(logits)))
        constraint.consume(token)
        grammar_s.append(time.perf_counter() - start)
        if token in tokenizer.eog_ids:
            break
        start = time.perf_counter()
        logits = engine.decode([cache], [token])[0]
        decode_s.append(time.perf_counter() - start)
    return float(np.median(grammar_s)), float(np.median(decode_s)), len(decode_s)


def compile_times(tokenizer: Tokenizer, template: ChatTemplate, tools: list[Tool]) -> tuple[float, float, float]:
    """Seconds for the planner to build and compile the forced-call grammar, cold and cached (a
    fresh planner whose llguidance tokenizer is already built, so only the grammar is timed), and
    for the first mask of a fresh constraint (llguidance builds lexer states as they are reached)."""
    planner = ReplyPlanner(tokenizer, template)
    planner.warm_up()
    request = forced(tools)
    start = time.perf_counter()
    grammar = planner.plan(request, "").grammar
    cold = time.perf_counter() - start
    start = time.perf_counter()
    planner.plan(request, "")
    cached = time.perf_counter() - start
    assert grammar is not None and (constraint := grammar.constraint()) is not None
    start = time.perf_counter()
    constraint.mask(np.zeros(tokenizer.vocab_size, dtype=np.float32))
    return cold, cached, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="a GGUF (default: the embedded SmolLM2)")
    parser.add_argument("--steps", type=int, default=64, help="decode at most this many tokens per call")
    args = parser.parse_args()
    gguf = GGUFFile(args.model or default_model_path())
    tokenizer = Tokenizer.from_gguf(gguf)
    engine = load_engine("cpu", gguf, ModelConfig.from_gguf(gguf))
    agent_tools = claude_code_tools()
    start = time.perf_counter()
    _ = Grammars(tokenizer).ll_tokenizer
    print(f"{gguf.path.name}, NumPy engine; llguidance's tokenizer for this vocabulary: "
          f"{(time.perf_counter() - start) * 1e3:.0f} ms (once per model)")
    header = ["format", "1 tool: grammar / decode per token", "share", f"{len(agent_tools)} tools: per token",
              "share", "compile cold", "compile cached", "first mask"]
    rows = [header]
    for name, file in TEMPLATES.items():
        template = ChatTemplate((DATA / "templates" / file).read_text())
        planner = ReplyPlanner(tokenizer, template)
        cells = [name]
        for tools in ([WEATHER], agent_tools):
            grammar_s, decode_s, done = per_token(engine, tokenizer, planner, tools, args.steps)
            cells += [f"{grammar_s * 1e3:.2f} ms / {decode_s * 1e3:.1f} ms ({done} tokens)",
                      f"{grammar_s / decode_s:.1%}"]
        cold, cached, first = compile_times(tokenizer, template, agent_tools)
        cells += [f"{cold * 1e3:.0f} ms", f"{cached * 1e3:.1f} ms", f"{first * 1e3:.1f} ms"]
        rows.append(cells)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for i, row in enumerate(rows):
        print(" | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
        if i == 0:
            print("-|-".join("-" * w for w in widths))


if __name__ == "__main__":
    main()
