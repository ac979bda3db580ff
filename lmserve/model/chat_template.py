"""The model's chat template, rendered exactly as Hugging Face's `apply_chat_template` renders it.

Templates are written against transformers' Jinja environment (trim_blocks, lstrip_blocks, loop controls,
its own `tojson`, `raise_exception`, `strftime_now`) and its input preparation (None-valued message keys
dropped, reasoning aliased under `reasoning_content` and `thinking`), so prompts only match the ones a
model was trained on if all of that is reproduced. Doing it here with jinja2 avoids importing
transformers at startup. Templates come from model files, so they run in the immutable sandbox.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.meta
import jinja2.nodes
import jinja2.utils
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from lmserve.model.gguf_file import GGUFFile, ModelLoadError
from lmserve.model.tokenizer import Tokenizer

# transformers' fallback when a model has no template (and llama.cpp's).
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>'"
    " + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_PROBE_TOOLS = [{"type": "function", "function": {"name": name, "description": name, "parameters": {
    "type": "object", "properties": {}}}} for name in ("probe_a", "probe_b")]


class TemplateError(Exception):
    """A chat template that cannot render this conversation; the message is meant for the client (400)."""


class _Generation(Extension):
    """`{% generation %}` marks assistant text for training masks; rendering just outputs the body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _TemplateDict:
    """`dict(...)` in templates without handing them the `dict` type itself (as transformers does)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore attributes, closing a sandbox escape (as transformers does)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # no named `self`, like jinja's Namespace
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"templates cannot set underscore attributes ({name!r})")


def _raise_exception(message: str) -> None:
    """Templates reject conversations they cannot format this way (e.g. roles out of order)."""
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' `tojson`: no HTML escaping, non-ASCII kept, json.dumps' layout options exposed."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    """Today's date for templates that put it in the system prompt (Llama 3)."""
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    """transformers' environment: same options, extensions, filters and globals."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                       namespace=_Namespace)
    return env


def _plain(value: Any) -> Any:
    """A JSON-shaped copy of template input, so the sandbox only ever sees plain dicts, lists and scalars."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    for base in (str, int, float):  # subclasses (enums and the like) lose their extra methods
        if isinstance(value, base):
            return base(value)
    return f"<{type(value).__name__}>"


def _prepare(messages: list[dict]) -> list[dict]:
    """transformers' message preparation: drop None values, alias reasoning under both names."""
    out = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise TemplateError(f"chat messages must be objects, got {type(message).__name__}")
        message = {k: v for k, v in _plain(message).items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


class ChatTemplate:
    """A compiled chat template plus the special-token strings Hugging Face passes to it."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None,
                 tool_use_source: str | None = None) -> None:
        env = _environment()
        try:
            self._default = env.from_string(source)
            self._tool_use = env.from_string(tool_use_source) if tool_use_source else None
            variables = set(jinja2.meta.find_undeclared_variables(env.parse(source)))
            if tool_use_source:
                variables |= jinja2.meta.find_undeclared_variables(env.parse(tool_use_source))
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateError(f"chat template does not compile (line {exc.lineno}): {exc.message}") from None
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self.supports_tools = "tools" in variables
        self.supports_thinking = "enable_thinking" in variables
        self.supports_effort = "reasoning_effort" in variables  # gpt-oss: "low" | "medium" | "high"
        self.supports_system = self._accepts_system()
        # A system turn after the first message (Claude Code sends one) is refused by some (Qwen3.5).
        self.system_anywhere = self.supports_system and self._renders(
            [{"role": "user", "content": "a"}, {"role": "system", "content": "s"}]) is not None
        # Roles must alternate user/assistant (Gemma, Mistral): two user turns in a row are refused.
        self.alternates = (self._renders([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                          {"role": "user", "content": "c"}]) is not None
                           and self._renders([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
                           is None)
        # How past calls must be shaped (see _probe_calls); all True for a template without tools.
        self.short_call_ids = False  # Mistral: call ids are 9 alphanumerics
        self.parallel_calls = True  # False: one call per assistant turn (Llama 3.1 raises, gpt-oss drops the rest)
        self.calls_take_text_and_thinking = True  # False: gpt-oss refuses both on a call turn
        self.user_after_results = True  # False: Mistral wants the assistant's answer after tool results
        self.results_on_call_turn = False  # True: results are read from the call turn (Gemma 4's older template)
        self.tools_need_description = False  # True: gpt-oss's template fails on a tool without one
        if self.supports_tools:
            self._probe_calls()
            bare = [{"type": "function", "function": {"name": "probe", "parameters": {"type": "object"}}}]
            described = [{"type": "function", "function": {**bare[0]["function"], "description": ""}}]
            probe = [{"role": "user", "content": "x"}]
            self.tools_need_description = self._renders(probe, bare) is None and self._renders(probe, described) is not None

    def _renders(self, messages: list[dict], tools: list[dict] | None = None) -> str | None:
        """The prompt for a probe conversation, or None when the template refuses it."""
        try:
            return self.render(messages, tools=tools)
        except TemplateError:
            return None

    def _call_turns(self, call_id: str, names: tuple[str, ...] = ("probe_a",), content: str = "",
                    thinking: str | None = None, then: tuple[dict, ...] = ()) -> str | None:
        """A probe: a user turn, an assistant turn calling `names`, their results, `then`."""
        calls = [{"id": call_id, "type": "function", "function": {"name": n, "arguments": {}}} for n in names]
        turn = {"role": "assistant", "content": content, "tool_calls": calls, "reasoning_content": thinking}
        results = [{"role": "tool", "tool_call_id": call_id, "name": n, "content": "r"} for n in names]
        return self._renders([{"role": "user", "content": "x"}, turn, *results, *then], _PROBE_TOOLS)

    def _probe_calls(self) -> None:
        """What the template makes of past calls: which ids it accepts, whether one assistant turn
        may hold two calls, whether a call turn may carry both text and reasoning, whether a user
        turn may follow the results."""
        long_id, short_id = "call_0123456789abcdef", "a0b1c2d3e"
        self.short_call_ids = self._call_turns(long_id) is None and self._call_turns(short_id) is not None
        call_id = short_id if self.short_call_ids else long_id
        one = self._call_turns(call_id)
        if one is None:
            return  # the probe itself is refused: nothing can be learnt from it
        both = self._call_turns(call_id, ("probe_a", "probe_b"))  # probe_b is declared in both prompts
        self.parallel_calls = both is not None and both.count("probe_b") > one.count("probe_b")
        self.calls_take_text_and_thinking = self._call_turns(call_id, content="c", thinking="t") is not None
        self.user_after_results = self._call_turns(call_id, then=({"role": "user", "content": "y"},)) is not None
        self.results_on_call_turn = self._reads_results_from_call_turn(call_id)

    def _reads_results_from_call_turn(self, call_id: str) -> bool:
        """The template shows results given on the call turn (`tool_responses`, Gemma 4's native
        shape) and renders them otherwise when they come as tool turns: it only knows the former."""
        user = {"role": "user", "content": "x"}
        call = {"role": "assistant", "content": "", "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "probe_a", "arguments": {}}}]}
        mark = "probe_result_0f3a"
        on_turn = self._renders([user, {**call, "tool_responses": [{"name": "probe_a", "response": mark}]}],
                                _PROBE_TOOLS)
        as_turns = self._renders([user, call, {"role": "tool", "tool_call_id": call_id, "name": "probe_a",
                                               "content": mark}], _PROBE_TOOLS)
        return on_turn is not None and mark in on_turn and on_turn != as_turns

    def _accepts_system(self) -> bool:
        """False for templates that raise on a system turn (Gemma 1/2's) but render without one."""
        probe = [{"role": "user", "content": "x"}]
        try:
            self.render([{"role": "system", "content": "s"}, *probe])
            return True
        except TemplateError:
            try:
                self.render(probe)
            except TemplateError:
                return True  # it fails either way: not the system turn's fault
            return False

    @classmethod
    def from_gguf(cls, gguf: GGUFFile, tokenizer: Tokenizer, source: str | None = None) -> ChatTemplate:
        """The file's template (ChatML when it has none), or `source` in its place (and in place of
        its tool-use variant), with the file's bos/eos/unk/pad token strings. A `source` that does
        not compile raises TemplateError (its caller knows where it came from)."""
        md = gguf.metadata
        special = {"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token}
        for name, key in (("unk_token", "unknown"), ("pad_token", "padding")):
            token_id = md.get(f"tokenizer.ggml.{key}_token_id")
            if token_id is not None and 0 <= token_id < tokenizer.vocab_size:
                special[name] = tokenizer.piece(token_id)
        try:
            return cls(source or md.get("tokenizer.chat_template") or CHATML_TEMPLATE,
                       {k: v for k, v in special.items() if v is not None},
                       None if source else md.get("tokenizer.chat_template.tool_use"))
        except TemplateError as exc:
            if source:
                raise
            raise ModelLoadError(f"{gguf.path.name}: {exc}") from None

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
               **template_kwargs: Any) -> str:
        """The prompt for `messages`; keyword arguments (enable_thinking, documents, ...) reach the template."""
        template = self._tool_use if tools is not None and self._tool_use is not None else self._default
        context = {"documents": None, **self.special_tokens, **_plain(template_kwargs)}
        try:
            return template.render(messages=_prepare(messages), tools=_plain(tools),
                                   add_generation_prompt=add_generation_prompt, **context)
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template error: {exc.message or exc}") from None
        except (TypeError, ValueError, LookupError, ArithmeticError, AttributeError) as exc:
            raise TemplateError(f"chat template failed on these messages: {exc}") from None
