"""The model's tokenizer, built straight from GGUF metadata into a `tokenizers.Tokenizer`.

A GGUF carries no tokenizer.json, only the vocabulary, merges (or SentencePiece scores), token types
and a pre-tokenizer name. Building the Rust tokenizer from those arrays takes well under a second, and
follows llama.cpp where it and Hugging Face's GGUF converter differ: the pre-tokenizer table, which
tokens end generation, which ones are special, and when BOS is added.

Decoding is plain byte concatenation of `token_bytes`, so whole-text decoding and UTF-8-safe streaming
can never disagree.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cached_property
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from lmserve.model.gguf_file import GGUFFile, ModelLoadError
from lmserve.model.pretokenizers import GEMMA4, PRE_TOKENIZERS, pre_tokenizer

# llama.cpp token types (tokenizer.ggml.token_type); 5 (unused) and 0 (undefined) render as nothing.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6

SPM_SPACE = "\u2581"  # SentencePiece's visible space, "▁"

# Token texts llama.cpp treats as end of generation whatever their type (llama-vocab.cpp, `special_eog_ids`).
EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
})
# Fill-in-the-middle tokens llama.cpp also stops on, found by metadata id or else by text.
FIM_EOG = {
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte (the `bytes_to_unicode` table)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


BYTE_LEVEL_CHARS = _byte_level_alphabet()
# str.translate table to a latin-1 string of the bytes: a stand-in character becomes its byte, any other
# character below U+0100 its own UTF-8, so `.encode("latin-1")` yields the bytes in one C-level pass.
_BYTE_LEVEL_TABLE = {b: chr(b).encode().decode("latin-1") for b in range(256)}
_BYTE_LEVEL_TABLE.update({ord(c): chr(b) for c, b in BYTE_LEVEL_CHARS.items()})


def _byte_level_bytes(text: str) -> bytes:
    """The bytes a byte-level token spells; characters outside the alphabet stand for their UTF-8."""
    try:
        return text.translate(_BYTE_LEVEL_TABLE).encode("latin-1")
    except UnicodeEncodeError:  # a character above U+00FF that is not a stand-in
        return b"".join(bytes([BYTE_LEVEL_CHARS[c]]) if c in BYTE_LEVEL_CHARS else c.encode() for c in text)


LONG_TEXT = 16_384  # characters past which encoding runs without the GIL (other threads go on)


class Tokenizer:
    """Text <-> token ids for one model, plus the per-token bytes that streaming and logprobs need."""

    def __init__(
        self,
        backend: HFTokenizer,
        token_bytes: list[bytes],
        *,
        special_ids: frozenset[int],
        eog_ids: frozenset[int],
        bos_id: int | None,
        eos_id: int | None,
        add_bos: bool,
        add_eos: bool,
    ) -> None:
        self.backend = backend  # the Rust tokenizer, for libraries that take one (llguidance)
        self._token_bytes = token_bytes
        self.vocab_size = len(token_bytes)
        self.special_ids = special_ids
        self.eog_ids = eog_ids
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.add_bos = add_bos
        self.add_eos = add_eos
        self._prefix = [bos_id] if add_bos and bos_id is not None else []
        self._suffix = [eos_id] if add_eos and eos_id is not None else []
        self.bos_token = self.piece(bos_id) if bos_id is not None else None
        self.eos_token = self.piece(eos_id) if eos_id is not None else None

    # -- building ----------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> Tokenizer:
        md = gguf.metadata
        tokens: list[str] = md.get("tokenizer.ggml.tokens") or []
        if not tokens:
            raise ModelLoadError(f"{gguf.path.name} has no tokenizer vocabulary (tokenizer.ggml.tokens)")
        raw_types = md.get("tokenizer.ggml.token_type")
        types: list[int] = raw_types.tolist() if raw_types is not None else [NORMAL] * len(tokens)
        kind = md.get("tokenizer.ggml.model")
        if kind == "gpt2":
            pre = pre_tokenizer(md.get("tokenizer.ggml.pre"))
            if pre is None:
                raise ModelLoadError(
                    f"{gguf.path.name}: unsupported pre-tokenizer '{md.get('tokenizer.ggml.pre')}' "
                    f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})"
                )
            backend = _byte_level_backend(tokens, md.get("tokenizer.ggml.merges") or [], pre.regexes, pre.ignore_merges)
            add_bos_default = pre.add_bos
        elif kind == "llama":
            backend = _sentencepiece_backend(tokens, md, types)
            add_bos_default = True
        elif kind == "gemma4":
            backend = _gemma4_backend(tokens, md)
            add_bos_default = True
        else:
            raise ModelLoadError(f"{gguf.path.name}: unsupported tokenizer model '{kind}' "
                                 "(supported: gpt2, llama, gemma4)")

        eog_ids = _eog_ids(md, tokens)
        special_ids = frozenset(i for i, t in enumerate(types) if t in (CONTROL, UNKNOWN)) | eog_ids
        user_defined = [i for i, t in enumerate(types) if t == USER_DEFINED and i not in special_ids]
        backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                    for i in sorted(special_ids) if tokens[i]])
        backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user_defined if tokens[i]])

        token_bytes = _token_bytes(tokens, types, special_ids, byte_level=kind == "gpt2")
        bos_id, eos_id = _token_id(md, "bos", tokens), _token_id(md, "eos", tokens)
        # llama.cpp adds BOS to every Gemma 4 prompt whatever the file says (its PR 21500)
        add_bos = bool(md.get("tokenizer.ggml.add_bos_token", add_bos_default)) or kind == "gemma4"
        add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False))
        if (add_bos and bos_id is None) or (add_eos and eos_id is None):
            raise ModelLoadError(f"{gguf.path.name} asks for BOS/EOS to be added but does not name the token")
        return cls(backend, token_bytes, special_ids=special_ids, eog_ids=eog_ids, bos_id=bos_id, eos_id=eos_id,
                   add_bos=add_bos, add_eos=add_eos)

    # -- encoding ----------------------------------------------------------------------------

    @cached_property
    def _literal_backend(self) -> HFTokenizer:
        """A copy that reads special-token text as plain text (user-defined tokens still match)."""
        backend = HFTokenizer.from_str(self.backend.to_str())
        backend.encode_special_tokens = True
        return backend

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids for `text`; `parse_special=False` keeps user text from injecting control tokens."""
        ids: list[int] = self._encoding(text, parse_special).ids
        return [*self._prefix, *ids, *self._suffix] if add_special else ids

    def count(self, text: str, add_special: bool = True, parse_special: bool = True) -> int:
        """How many ids `encode` gives, without making them Python ints (a million of them hold the
        GIL for a tenth of a second: other requests' threads wait)."""
        n = len(self._encoding(text, parse_special))
        return n + (len(self._prefix) + len(self._suffix) if add_special else 0)

    def _encoding(self, text: str, parse_special: bool) -> Any:
        backend = self.backend if parse_special else self._literal_backend
        if len(text) > LONG_TEXT:  # `encode_batch` lets go of the GIL (`encode` held it 1.5 s for 3 MB)
            return backend.encode_batch([text], add_special_tokens=False)[0]
        return backend.encode(text, add_special_tokens=False)

    # -- decoding ----------------------------------------------------------------------------

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for; may be part of a multi-byte UTF-8 character."""
        return self._token_bytes[token_id]

    def piece(self, token_id: int) -> str:
        """The token's text decoded on its own (broken UTF-8 shows as U+FFFD)."""
        return self._token_bytes[token_id].decode("utf-8", errors="replace")

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """The text of a token sequence: its bytes concatenated, with no space clean-up."""
        table, special = self._token_bytes, self.special_ids
        data = b"".join(table[i] for i in ids if not (skip_special and i in special))
        return data.decode("utf-8", errors="replace")


# -- helpers -----------------------------------------------------------------------------------


def _byte_level_backend(tokens: list[str], merges: list[str], regexes: tuple[str, ...],
                        ignore_merges: bool) -> HFTokenizer:
    """GPT-2-style BPE: regex splits, bytes shown as printable characters, ranked merges."""
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]  # llama.cpp splits at the first space after position 0
    backend = HFTokenizer(models.BPE(vocab, pairs, ignore_merges=ignore_merges))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_backend(tokens: list[str], md: dict[str, Any], types: list[int]) -> HFTokenizer:
    """SentencePiece BPE as llama.cpp runs it: best-scoring merge first, "▁" for spaces, <0xXX> fallback."""
    scores = md.get("tokenizer.ggml.scores")
    scores = scores.tolist() if scores is not None else [0.0] * len(tokens)
    vocab = {token: i for i, token in enumerate(tokens)}
    merges = []  # every way to build a normal token from two tokens, best-scoring result first
    for token, kind, score in zip(tokens, types, scores, strict=True):
        if kind == NORMAL:
            merges.extend((-score, -cut, cut - len(token), token[:cut], token[cut:])
                          for cut in range(1, len(token)) if token[:cut] in vocab and token[cut:] in vocab)
    merges.sort(key=lambda m: m[:3])  # ties ordered as transformers' generate_merges orders them
    # llama.cpp prefixes every text fragment between special tokens with a space, unconditionally; a
    # normalizer runs per fragment, unlike Metaspace which skips text already starting with a space.
    return _spm_bpe_backend(tokens, [m[3:] for m in merges], md,
                            space_prefix=bool(md.get("tokenizer.ggml.add_space_prefix", True)))


def _gemma4_backend(tokens: list[str], md: dict[str, Any]) -> HFTokenizer:
    """Gemma 4's BPE (llama.cpp's tokenizer model "gemma4", pre-tokenizer GEMMA4): the file's ranked
    merges over "▁"-spaced raw UTF-8, no space prefix, pieces cut at newline runs, <0xXX> fallback.
    llama.cpp takes a newline run that is a token whole, merges or not: the newline tokens are
    added whole, matched longest first. That is llama.cpp's rule wherever the run's length is a
    token; a longer run llama.cpp merges by rank, this takes the longest token first (SentencePiece's
    way with such pieces). `ignore_merges` would keep llama.cpp's rule there but also take a line
    that is only a byte or control token's text (`<0x41>`) as that token, which llama.cpp spells out."""
    merges = [tuple(m.split(" ", 1)) for m in md.get("tokenizer.ggml.merges") or []]
    backend = _spm_bpe_backend(tokens, merges, md, space_prefix=False)
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in GEMMA4.regexes])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in tokens if t and not t.strip("\n")])
    return backend


def _spm_bpe_backend(tokens: list[str], merges: list[tuple[str, ...]], md: dict[str, Any],
                     space_prefix: bool) -> HFTokenizer:
    """BPE over text whose spaces are "▁", falling back to <0xXX> byte tokens, decoded back alike."""
    unk_id = _token_id(md, "unknown", tokens)
    backend = HFTokenizer(models.BPE(
        {token: i for i, token in enumerate(tokens)}, merges, byte_fallback=True, fuse_unk=True,
        unk_token=tokens[unk_id] if unk_id is not None else None,
    ))
    steps = [normalizers.Replace(" ", SPM_SPACE)]
    if space_prefix:
        steps.insert(0, normalizers.Prepend(SPM_SPACE))
    backend.normalizer = normalizers.Sequence(steps)
    backend.decoder = decoders.Sequence([decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return backend


def _token_bytes(tokens: list[str], types: list[int], special_ids: frozenset[int], byte_level: bool) -> list[bytes]:
    """Per-token bytes as llama.cpp's token_to_piece(special=True) renders them."""
    out = []
    for i, (token, kind) in enumerate(zip(tokens, types, strict=True)):
        if i in special_ids or kind in (CONTROL, UNKNOWN, USER_DEFINED):
            out.append(token.encode())
        elif kind == BYTE and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            out.append(bytes([int(token[3:5], 16)]))
        elif kind == NORMAL:
            out.append(_byte_level_bytes(token) if byte_level else token.replace(SPM_SPACE, " ").encode())
        else:
            out.append(b"")
    return out


def _token_id(md: dict[str, Any], name: str, tokens: list[str]) -> int | None:
    """A `tokenizer.ggml.<name>_token_id`, or None when absent or out of range."""
    value = md.get(f"tokenizer.ggml.{name}_token_id")
    return int(value) if value is not None and 0 <= int(value) < len(tokens) else None


def _eog_ids(md: dict[str, Any], tokens: list[str]) -> frozenset[int]:
    """End-of-generation ids the way llama.cpp collects them: named ids, FIM tokens and known texts."""
    ids = {i for i in (_token_id(md, k, tokens) for k in ("eos", "eot", "eom")) if i is not None}
    by_text: dict[str, int] = {}
    for i, token in enumerate(tokens):
        if token in EOG_TEXTS:
            ids.add(i)
        by_text.setdefault(token, i)
    for key, texts in FIM_EOG.items():
        fim = _token_id(md, key, tokens)
        if fim is None:
            fim = next((by_text[t] for t in texts if t in by_text), None)
        if fim is not None:
            ids.add(fim)
    # llama.cpp's rule for gpt-oss's harmony vocabulary: with <|return|> and <|call|> present,
    # <|end|> only closes a message inside the turn (the analysis before the answer or a call).
    if "<|return|>" in by_text and "<|call|>" in by_text and "<|end|>" in by_text:
        ids.discard(by_text["<|end|>"])
    return frozenset(ids)
