"""`tokenizer.ggml.pre` -> how a byte-level BPE vocabulary splits text before merging.

A GGUF names its pre-tokenizer instead of storing it; the table below is llama.cpp's
(`llm_tokenizer_bpe` in llama-vocab.cpp). llama.cpp applies each regex in turn to the pieces the
previous one left, keeping both the matches and the text between them; a sequence of `tokenizers`
`Split(..., "isolated")` pre-tokenizers does exactly that. Where llama.cpp rewrites a Hugging Face
regex only because `std::regex` lacks a feature (`(?i:...)`, `\\p{Lu}`), the contraction rewrite is
kept (it is exact for ASCII) and the letter-case classes of tekken and gpt-4o use the original,
which is what the model was trained with.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PreTokenizer:
    """The regexes applied in order, and the llama.cpp flags that come with a pre-tokenizer type."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a piece that is already a token is emitted whole (tiktoken-style)
    add_bos: bool = False  # llama.cpp's default when the file has no tokenizer.ggml.add_bos_token


_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_TEKKEN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CJK_CODER = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_CJK_V3 = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
_DEEPSEEK_V3 = (
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_DEFAULT = PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))

_GROUPS: tuple[tuple[tuple[str, ...], PreTokenizer], ...] = (
    (("default",), _DEFAULT),
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"),
     PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)),
    (("dbrx", "smaug-bpe", "glm4", "chatglm-bpe"), PreTokenizer((_LLAMA3,))),
    (("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
      "modern-bert", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4"),
     PreTokenizer((_GPT2,))),
    (("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b", "mellum2"),
     PreTokenizer((r"\p{N}", _GPT2))),
    (("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open", "grok-2"),
     PreTokenizer((_QWEN2,))),
    (("qwen35",), PreTokenizer((_QWEN35,))),
    (("tekken",), PreTokenizer((_TEKKEN,), ignore_merges=True, add_bos=True)),
    (("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), PreTokenizer((_GPT4O,))),
    (("deepseek-coder",), PreTokenizer((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_CODER, r"\p{N}"))),
    (("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"), PreTokenizer((r"\p{N}{1,3}", _CJK_V3, _DEEPSEEK_V3))),
    (("falcon",), PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"))),
    (("poro-chat", "bloom", "gpt3-finnish"), PreTokenizer((r" ?[^(\s|.,!?…。，、।۔،)]+",))),
    (("seed-coder",), PreTokenizer((
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",))),
    (("bailingmoe", "bailingmoe2", "llada-moe"), PreTokenizer((
        r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",))),
    (("minicpm5",), PreTokenizer((
        r"\p{N}{1,3}",
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ), ignore_merges=True)),
)

PRE_TOKENIZERS: dict[str, PreTokenizer] = {name: pre for names, pre in _GROUPS for name in names}

# The pre-tokenizer llama.cpp forces for its "gemma4" tokenizer model (BPE over "▁"-spaced raw
# UTF-8, not byte-level, so not one of the table's): text is cut only into runs of newlines and the
# runs between them; a newline run that is a token is that token (ggml-org/llama.cpp#21343), which
# the tokenizer does by adding the newline tokens whole (see tokenizer.py).
GEMMA4 = PreTokenizer((r"[^\n]+|[\n]+",))


def pre_tokenizer(name: str | None) -> PreTokenizer | None:
    """The pre-tokenizer a GGUF names (llama.cpp falls back to 'default' when none is named), or None."""
    return PRE_TOKENIZERS.get(name or "default")
