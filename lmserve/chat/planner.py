"""Request -> ReplyPlan, at admission on the connection's side.

Grammars are compiled here, before the job is queued, so an invalid grammar or an unsupported
schema keyword is a 400 carrying llguidance's message instead of a failure inside a started stream.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable

from lmserve.chat import harmony, tool_format
from lmserve.chat.grammar import CompiledGrammar, GrammarError, Grammars
from lmserve.chat.grammar_sources import call_grammar, output_grammar
from lmserve.chat.reply import ReplyPlan
from lmserve.chat.reply_router import GEMMA4_THINK, THINK, CallRouting
from lmserve.chat.tool_format import GEMMA4, HARMONY, ToolFormat
from lmserve.core.errors import RequestError
from lmserve.core.types import ChatRequest, OutputFormat, Tool
from lmserve.model.chat_template import ChatTemplate
from lmserve.model.tokenizer import Tokenizer

_UNDETECTED = object()


class ReplyPlanner:
    """Knows the model's reply conventions (think tags or harmony channels, tool-call format) and
    compiles grammars."""

    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.grammars = Grammars(tokenizer)
        family = tool_format.family_of(template)
        self.harmony = family == HARMONY  # gpt-oss: the reply is channels
        self.think_markers = GEMMA4_THINK if family == GEMMA4 else THINK
        self.think = not self.harmony and (template.supports_thinking or self.think_markers.open in template.source)
        close = harmony.CLOSE_ANALYSIS if self.harmony else self.think_markers.forced_close
        self._close_think = tokenizer.encode(close, add_special=False, parse_special=True)
        self._format: ToolFormat | None | object = _UNDETECTED
        self._format_lock = threading.Lock()

    def warm_up(self) -> None:
        """Do the slow first-use work (importing the tool parsers, building llguidance's tokenizer)
        ahead of the first request that needs it; called from a background thread at startup."""
        _ = self.tool_format
        _ = self.grammars.ll_tokenizer

    @property
    def tool_format(self) -> ToolFormat | None:
        """Detected on the first request with tools (it imports mlx-lm)."""
        with self._format_lock:
            if self._format is _UNDETECTED:
                self._format = tool_format.detect(self.template, self.tokenizer.backend.get_vocab())
            return self._format  # type: ignore[return-value]

    def marker(self, text: str) -> str:
        """`text` in Lark: the special token it is, or a quoted literal."""
        ids = self.tokenizer.encode(text, add_special=False, parse_special=True)
        if len(ids) == 1 and ids[0] in self.tokenizer.special_ids:
            return f"<[{ids[0]}]>"
        return json.dumps(text)

    def plan(self, request: ChatRequest, prompt: str) -> ReplyPlan:
        """Raises RequestError (400) for a grammar that does not compile or a tool_choice that
        names no offered tool. A forced tool_choice is a grammar over the whole reply in the
        family's own call format; under auto the same call grammar guards each call once it opens."""
        plan = ReplyPlan(think=self.think, think_markers=self.think_markers, thinking_budget=request.thinking_budget,
                         close_think=self._close_think, single_call=request.single_call,
                         end_ids=frozenset(self.tokenizer.eog_ids))
        fmt_request = request.output_format
        if fmt_request is not None:
            plan.grammar = self._compile(lambda: output_grammar(fmt_request), fmt_request.param)
        tools = request.offered_tools
        choice = request.tool_choice
        if choice.forced and not tools:
            raise RequestError("tool_choice: a tool call was required but no tools were given", 400, "tool_choice")
        if choice.mode == "named" and choice.name not in {t.name for t in tools}:
            raise RequestError(f"tool_choice: {choice.name!r} is not among the tools", 400, "tool_choice")
        fmt = self.tool_format if tools else None
        if fmt is not None:
            plan.calls = CallRouting(fmt, [t.to_template() for t in tools], frozenset(t.name for t in tools))
        if choice.forced:
            candidates = [t for t in tools if choice.mode == "required" or t.name == choice.name]
            plan.grammar = self._call_grammar(fmt, candidates, forced=True)
        elif fmt is not None and fmt.grammar and plan.grammar is None:
            plan.call_grammar = self._call_grammar(fmt, tools, forced=False)
        if self.harmony:  # where the reply starts: a header, or inside a message the prompt opened
            plan.harmony = harmony.start_state(prompt, governed=plan.grammar is not None and not choice.forced)
        # Qwen3.5 with thinking on: the generation prompt opened `<think>`, the reply starts inside it
        # (and a grammar governs from its close on)
        plan.in_think = self.think and prompt.rstrip().endswith(self.think_markers.open)
        if request.reasoning_inline:
            plan.inline_reasoning = ((harmony.ANALYSIS_OPEN, harmony.END) if self.harmony
                                     else (self.think_markers.open, self.think_markers.close))
        return plan

    def plan_completion(self, output_format: OutputFormat | None) -> ReplyPlan:
        """The plan for a raw (legacy /v1/completions) prompt: no chat template, so no reasoning
        channel and no tools; only the output format's grammar, if any, governs the reply.
        Raises RequestError (400, naming `output_format.param`) for a grammar that does not compile."""
        plan = ReplyPlan()
        if output_format is not None:
            plan.grammar = self._compile(lambda: output_grammar(output_format), output_format.param)
        return plan

    def _call_grammar(self, fmt: ToolFormat | None, tools: list[Tool], forced: bool) -> CompiledGrammar:
        if fmt is None or not fmt.grammar:  # a family mlx-lm parses that has no call grammar here
            family = fmt.family if fmt else "unknown"
            raise RequestError(f"tool_choice: forcing a call is not supported for this model's tool-call "
                               f"format ({family}); use auto", 400, "tool_choice")
        return self._compile(lambda: call_grammar(fmt, tools, self.marker, forced), "tools")

    def _compile(self, source: Callable[[], str], param: str) -> CompiledGrammar:
        try:
            return self.grammars.compile(source())
        except GrammarError as exc:
            raise RequestError(f"{param}: {exc}", 400, param) from None
