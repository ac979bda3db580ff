"""Tokenizer built from GGUF metadata: SmolLM2 goldens, the tiny fixture, synthetic SentencePiece and BPE vocabularies."""

from __future__ import annotations

import codecs
from pathlib import Path
from typing import Any

import gguf
import pytest
import regex

from lmserve.model.gguf_file import GGUFFile, ModelLoadError
from lmserve.model.pretokenizers import PRE_TOKENIZERS, pre_tokenizer
from lmserve.model.tokenizer import BYTE_LEVEL_CHARS, Tokenizer
from tests.conftest import TINY_LLAMA
from tests.families import ARCH
from tests.gemma4_vocab import NEWLINES, write_gemma4_vocab

pytestmark = pytest.mark.fast  # in-process: part of `scripts/test.sh -m fast`

TINY_LLAMA_F32 = TINY_LLAMA / "tiny-llama-F32.gguf"


@pytest.fixture(scope="module")
def smollm2(smollm2_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(smollm2_path))


def write_vocab(path: Path, model: str, tokens: list[str], types: list[int], **kv: object) -> GGUFFile:
    """A vocabulary-only GGUF; `kv` holds extra tokenizer.ggml.* keys (scores, merges, pre, ids, flags)."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model(model)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    for key, value in kv.items():
        if isinstance(value, list):
            writer.add_array(f"tokenizer.ggml.{key}", value)
        elif isinstance(value, bool):
            writer.add_bool(f"tokenizer.ggml.{key}", value)
        elif isinstance(value, int):
            writer.add_uint32(f"tokenizer.ggml.{key}", value)
        else:
            writer.add_string(f"tokenizer.ggml.{key}", str(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFFile(path)


# -- SmolLM2 (gpt2 BPE, pre "smollm") ---------------------------------------------------------------


def test_smollm2_goldens(smollm2: Tokenizer, tokenizer_goldens: list[dict]) -> None:
    assert tokenizer_goldens
    for case in tokenizer_goldens:
        text, ids = case["text"], case["ids"]
        assert ids == case["llama_cpp_ids"]
        assert smollm2.encode(text, add_special=False) == ids, text
        assert smollm2.encode(text) == ids, text  # SmolLM2 sets add_bos_token false
        assert smollm2.decode(ids) == case["decoded"], text
        assert b"".join(smollm2.token_bytes(i) for i in ids) == case["decoded"].encode(), text


def test_smollm2_special_tokens(smollm2: Tokenizer) -> None:
    assert smollm2.vocab_size == 49152
    assert (smollm2.bos_id, smollm2.eos_id, smollm2.add_bos, smollm2.add_eos) == (1, 2, False, False)
    assert (smollm2.bos_token, smollm2.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert smollm2.special_ids == frozenset(range(17))  # the 17 control tokens
    # <|endoftext|> and <|im_end|> by text, <reponame> as llama.cpp's FIM repo token
    assert smollm2.eog_ids == frozenset({0, 2, 4})
    assert smollm2.encode("<|im_start|>user") == [1, 4093]
    literal = smollm2.encode("<|im_start|>user", parse_special=False)
    assert len(literal) > 2 and not set(literal) & smollm2.special_ids
    assert smollm2.decode(literal) == "<|im_start|>user"
    ids = smollm2.encode("<|im_start|>user\nHi<|im_end|>")
    assert smollm2.decode(ids, skip_special=True) == "user\nHi"
    assert smollm2.piece(2) == "<|im_end|>" and smollm2.token_bytes(2) == b"<|im_end|>"


def test_smollm2_streaming_bytes(smollm2: Tokenizer) -> None:
    text = "emoji 🙂👍🏽 日本語 naïve"
    ids = smollm2.encode(text)
    decoder = codecs.getincrementaldecoder("utf-8")()
    assert "".join(decoder.decode(smollm2.token_bytes(i)) for i in ids) == text
    partial = [i for i in ids if smollm2.token_bytes(i)[-1:] >= b"\x80" and "\ufffd" in smollm2.piece(i)]
    assert partial, "some token should hold part of a multi-byte character"


# -- tiny-llama fixture (gpt2 BPE, pre "default", 512 tokens, 4 merges) -----------------------------


def test_tiny_llama_round_trip() -> None:
    tok = Tokenizer.from_gguf(GGUFFile(TINY_LLAMA_F32))
    assert tok.vocab_size == 512 and tok.eog_ids == frozenset({0, 2})
    for text in ("the cat sat on the mat", "Hello, World! 12345 +-=<>", "tab\tnew\nline  two   ", "'s 'll ~^|$"):
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    assert tok.encode(" the") == [259, 260]  # merges "Ġ t" then "h e"
    assert tok.encode("<|im_start|>hi<|im_end|>") == [1, 74, 75, 2]


# -- synthetic vocabularies ----------------------------------------------------------------------------


SPM_PIECES = ["▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "▁h", "▁w", "or", "llo", "▁he", "▁hello", "ld", "▁wor", "▁world"]


def spm_vocab(tmp_path: Path, **kv: object) -> Tokenizer:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES + ["<think>"]
    types = [2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES) + [4]
    scores = [0.0] * 259 + [-float(i) for i in range(len(SPM_PIECES))] + [0.0]
    file = write_vocab(tmp_path / "spm.gguf", "llama", tokens, types, scores=scores, bos_token_id=1,
                       eos_token_id=2, unknown_token_id=0, **kv)
    return Tokenizer.from_gguf(file)


def names(tok: Tokenizer, ids: list[int]) -> list[str]:
    return [tok.backend.id_to_token(i) for i in ids]


def test_sentencepiece(tmp_path: Path) -> None:
    tok = spm_vocab(tmp_path)
    assert tok.add_bos and tok.bos_id == 1 and tok.eog_ids == frozenset({2})
    ids = tok.encode("hello world")
    assert names(tok, ids) == ["<s>", "▁hello", "▁world"]
    assert tok.decode(ids) == "<s> hello world"  # bytes as they are: no leading-space strip
    assert tok.decode(ids, skip_special=True) == " hello world"
    # a character outside the vocabulary falls back to its UTF-8 bytes
    assert names(tok, tok.encode("hé", add_special=False)) == ["▁h", "<0xC3>", "<0xA9>"]
    assert tok.token_bytes(tok.encode("é", add_special=False)[1]) == b"\xc3"
    # every fragment after a special token gets the space prefix, as llama.cpp does
    assert names(tok, tok.encode("hello<think>world", add_special=False)) == ["▁hello", "<think>", "▁world"]
    assert names(tok, tok.encode("<s>hello", add_special=False, parse_special=False))[:2] == ["▁", "<0x3C>"]


def test_sentencepiece_without_space_prefix(tmp_path: Path) -> None:
    tok = spm_vocab(tmp_path, add_space_prefix=False, add_bos_token=False)
    assert names(tok, tok.encode("hello world")) == ["he", "llo", "▁world"]


# -- Gemma 4 (tokenizer model "gemma4": BPE over "▁"-spaced raw UTF-8) -----------------------------------


def gemma4_vocab(tmp_path: Path, add_bos: bool = True) -> tuple[GGUFFile, Tokenizer]:
    file = GGUFFile(write_gemma4_vocab(tmp_path / "gemma4.gguf", add_bos=add_bos))
    return file, Tokenizer.from_gguf(file)


def test_gemma4_vocabulary(tmp_path: Path) -> None:
    _, tok = gemma4_vocab(tmp_path)
    assert names(tok, tok.encode(" the a", add_special=False)) == ["▁the", "▁a"]  # ranked merges, no prefix space
    assert names(tok, tok.encode("the", add_special=False)) == ["t", "he"]
    assert names(tok, tok.encode("é", add_special=False)) == ["<0xC3>", "<0xA9>"]  # byte fallback
    # the chat markers are USER_DEFINED: whole tokens, not special, rendered as their text
    call = '<|tool_call>call:f{a:<|"|>x<|"|>}<tool_call|>'
    ids = tok.encode(call, add_special=False, parse_special=False)
    assert names(tok, ids)[:1] == ["<|tool_call>"] and names(tok, ids).count('<|"|>') == 2
    assert not set(ids) & tok.special_ids and tok.decode(ids) == call
    turn = tok.encode("<|turn>", add_special=False)
    assert len(turn) == 1 and turn[0] in tok.special_ids  # CONTROL
    assert turn[0] not in tok.encode("a<|turn>", add_special=False, parse_special=False)
    assert {tok.piece(i) for i in tok.eog_ids} == {"<eos>", "<turn|>", "<|tool_response>"}
    text = "Hello, Zürich 🙂\n\n  two  spaces\n"
    assert tok.decode(tok.encode(text, add_special=False)) == text
    assert b"".join(tok.token_bytes(i) for i in tok.encode(text, add_special=False)) == text.encode()


def test_gemma4_newline_runs_and_bos_as_llama_cpp(tmp_path: Path) -> None:
    """llama.cpp cuts the text at newline runs and takes a run that is a token whole, though no
    merge builds it (its PR 21343); it adds BOS whatever the file says (PR 21500). A line that is a
    byte token's text is spelled out, as there."""
    _, tok = gemma4_vocab(tmp_path, add_bos=False)
    assert names(tok, tok.encode("a" + NEWLINES + "b", add_special=False)) == ["a", NEWLINES, "b"]
    assert names(tok, tok.encode("a\n\n\n\nb", add_special=False)) == ["a", NEWLINES, "\n", "b"]  # longest first
    assert names(tok, tok.encode("he\nhe", add_special=False)) == ["he", "\n", "he"]
    assert names(tok, tok.encode("<0x41>\n", add_special=False))[:2] == ["<", "0"]
    assert tok.add_bos and names(tok, tok.encode("a"))[0] == "<bos>"


def transformers_tokenizer(file: GGUFFile) -> Any:
    """transformers' own tokenizer built from the file's tokenizer arrays (its GGUF reader needs torch;
    the builder does not)."""
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    md = file.metadata
    arrays = {name: md[f"tokenizer.{key}"] for key, name in mapping.GGUF_TOKENIZER_MAPPING["tokenizer"].items()
              if f"tokenizer.{key}" in md}
    arrays = {k: v.tolist() if hasattr(v, "tolist") else v for k, v in arrays.items()}
    return mapping.convert_gguf_tokenizer(md["general.architecture"], arrays)[0]


FIXTURE_SAMPLES = ("the cat in a hat", " the  a\n", "Zürich 🙂 ok café", "def add(a, b):\n    return a + b\n",
                   '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,unit:<|"|>celsius<|"|>}<tool_call|>',
                   "<|turn>user\nhi<turn|>\n<|turn>model\n<|channel>thought\n<channel|>", "a\n\nb",
                   "<|im_start|>user\nWhat is the weather?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
                   "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>",
                   "Numbers: 0 1 42 3.14 1e-6", "\u0915\u093f\u0924\u093e\u092c cafe\u0301", "<0x41>")


def test_gemma4_matches_transformers(tmp_path: Path) -> None:
    """transformers' own Gemma 4 tokenizer built from the same GGUF arrays gives the same ids, but
    for a newline run that only llama.cpp's rule takes whole."""
    file, tok = gemma4_vocab(tmp_path)
    hf = transformers_tokenizer(file)
    for text in FIXTURE_SAMPLES:
        assert tok.encode(text, add_special=False) == hf.encode(text, add_special_tokens=False).ids, text
    assert hf.encode(NEWLINES, add_special_tokens=False).ids != tok.encode(NEWLINES, add_special=False)


@pytest.mark.parametrize("family", ["gemma4", "qwen35"])
def test_new_family_fixtures_match_transformers(family: str) -> None:
    """The tiny Gemma 4 and Qwen3.5 fixtures' tokenizers (toy vocabularies in the real shapes, the
    chat markers USER_DEFINED) as transformers builds them from the same arrays. (Checked against
    llama.cpp's /tokenize too when written: the same ids for every sample, with and without BOS.)"""
    file = GGUFFile(ARCH / family / f"tiny-{family}-F16.gguf")
    tok, hf = Tokenizer.from_gguf(file), transformers_tokenizer(file)
    for text in FIXTURE_SAMPLES:
        assert tok.encode(text, add_special=False) == hf.encode(text, add_special_tokens=False).ids, text
        assert tok.decode(tok.encode(text, add_special=False)) == text


BYTE_CHARS = list(BYTE_LEVEL_CHARS)


def bpe_vocab(tmp_path: Path, pre: str, **kv: object) -> Tokenizer:
    tokens = BYTE_CHARS + ["Ġt", "he", "Ġthe", "12", "123", "<|eot_id|>", "<think>", "<|fim_pad|>", "</s>"]
    types = [1] * (len(tokens) - 4) + [3, 4, 3, 1]
    merges = ["Ġ t", "h e", "Ġt he", "1 2", "12 3"]
    return Tokenizer.from_gguf(write_vocab(tmp_path / "bpe.gguf", "gpt2", tokens, types, merges=merges, pre=pre,
                                           bos_token_id=0, eos_token_id=1, **kv))


def test_byte_level_special_tokens(tmp_path: Path) -> None:
    tok = bpe_vocab(tmp_path, "llama-bpe")
    eot, think, fim_pad, end_s = (len(BYTE_CHARS) + i for i in range(5, 9))
    assert tok.add_bos  # llama.cpp's default for llama3-style vocabularies
    assert tok.eog_ids == frozenset({1, eot, fim_pad, end_s})
    assert end_s in tok.special_ids and think not in tok.special_ids
    assert tok.encode("a<think>b<|eot_id|>", add_special=False) == [ord("a"), think, ord("b"), eot]
    literal = tok.encode("<think><|eot_id|>", add_special=False, parse_special=False)
    assert literal[0] == think and eot not in literal
    assert tok.encode(" the", add_special=False) == [len(BYTE_CHARS) + 2]


@pytest.mark.parametrize(("pre", "pieces"), [
    ("llama-bpe", ["123", "4"]), ("default", ["123", "4"]), ("qwen2", ["1", "2", "3", "4"]), ("smollm", ["1", "2", "3", "4"]),
])
def test_byte_level_digit_splits(tmp_path: Path, pre: str, pieces: list[str]) -> None:
    tok = bpe_vocab(tmp_path, pre)
    assert names(tok, tok.encode("1234", add_special=False)) == pieces


def test_unsupported_vocabularies(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="pre-tokenizer 'no-such-pre'"):
        bpe_vocab(tmp_path, "no-such-pre")
    with pytest.raises(ModelLoadError, match="tokenizer model 'bert'"):
        Tokenizer.from_gguf(write_vocab(tmp_path / "bert.gguf", "bert", ["[CLS]"], [3]))


# Pieces as llama.cpp's pre-tokenizer (llama-vocab.cpp, `llm_tokenizer_bpe`) cuts each sample, worked
# out by hand from its regexes: contractions, digit groups, leading spaces, newlines, punctuation runs.
SPLIT_SAMPLES = ("Hello, it's 2024!  日本語\n", "I'LL say we've got 1234567 ...!?\n\n\tgo   ",
                 "HTTPServer iPhone don't", "x = a+b;\r\n  return", "WE'RE HERE'S 3.14")
EXPECTED_SPLITS = {
    "gpt-2": [  # 's|'t|...| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S): lower-case contractions only
        ["Hello", ",", " it", "'s", " 2024", "!", " ", " 日本語", "\n"],
        ["I", "'", "LL", " say", " we", "'ve", " got", " 1234567", " ...!?", "\n\n", "\t", "go", "   "],
        ["HTTPServer", " iPhone", " don", "'t"],
        ["x", " =", " a", "+", "b", ";", "\r\n ", " return"],
        ["WE", "'", "RE", " HERE", "'", "S", " 3", ".", "14"],
    ],
    "smollm": [  # single digits first, then gpt-2
        ["Hello", ",", " it", "'s", " ", "2", "0", "2", "4", "!", " ", " 日本語", "\n"],
        ["I", "'", "LL", " say", " we", "'ve", " got", " ", "1", "2", "3", "4", "5", "6", "7", " ...!?", "\n\n",
         "\t", "go", "   "],
        ["HTTPServer", " iPhone", " don", "'t"],
        ["x", " =", " a", "+", "b", ";", "\r\n ", " return"],
        ["WE", "'", "RE", " HERE", "'", "S", " ", "3", ".", "1", "4"],
    ],
    "default": [  # punctuation runs, gpt-2, digit runs, then groups of three digits
        ["Hello", ",", " it", "'", "s", " ", "202", "4", "!", " ", " 日本語", "\n"],
        ["I", "'", "LL", " say", " we", "'", "ve", " got", " ", "123", "456", "7", " ", "...!?", "\n\n", "\t", "go",
         "   "],
        ["HTTPServer", " iPhone", " don", "'", "t"],
        ["x", " ", "=", " a", "+", "b", ";", "\r\n ", " return"],
        ["WE", "'", "RE", " HERE", "'", "S", " ", "3", ".", "14"],
    ],
    "llama-bpe": [  # any-case contractions, \p{N}{1,3}, a non-letter glued to the word after it
        ["Hello", ",", " it", "'s", " ", "202", "4", "!", " ", " 日本語", "\n"],
        ["I", "'LL", " say", " we", "'ve", " got", " ", "123", "456", "7", " ...!?\n\n", "\tgo", "   "],
        ["HTTPServer", " iPhone", " don", "'t"],
        ["x", " =", " a", "+b", ";\r\n", " ", " return"],
        ["WE", "'RE", " HERE", "'S", " ", "3", ".", "14"],
    ],
    "qwen2": [  # as llama3 with single digits
        ["Hello", ",", " it", "'s", " ", "2", "0", "2", "4", "!", " ", " 日本語", "\n"],
        ["I", "'LL", " say", " we", "'ve", " got", " ", "1", "2", "3", "4", "5", "6", "7", " ...!?\n\n", "\tgo",
         "   "],
        ["HTTPServer", " iPhone", " don", "'t"],
        ["x", " =", " a", "+b", ";\r\n", " ", " return"],
        ["WE", "'RE", " HERE", "'S", " ", "3", ".", "1", "4"],
    ],
    "gpt-4o": [  # case-aware words carrying their contraction, \p{N}{1,3}
        ["Hello", ",", " it's", " ", "202", "4", "!", " ", " 日本語", "\n"],
        ["I'LL", " say", " we've", " got", " ", "123", "456", "7", " ...!?\n\n", "\tgo", "   "],
        ["HTTPServer", " i", "Phone", " don't"],
        ["x", " =", " a", "+b", ";\r\n", " ", " return"],
        ["WE'RE", " HERE'S", " ", "3", ".", "14"],
    ],
    "deepseek-v3": [  # digit groups and CJK runs isolated before the main regex
        ["Hello", ",", " it", "'s", " ", "202", "4", "!", "  ", "日本語", "\n"],
        ["I", "'LL", " say", " we", "'ve", " got", " ", "123", "456", "7", " ...!?\n\n", "\tgo", "   "],
        ["HTTPServer", " iPhone", " don", "'t"],
        ["x", " =", " a", "+b", ";\r\n", " ", " return"],
        ["WE", "'RE", " HERE", "'S", " ", "3", ".", "14"],
    ],
}


def pre_tokenize(tok: Tokenizer, text: str) -> list[str]:
    """The pieces the tokenizer's own pre-tokenizer cuts `text` into, byte-level stand-ins undone."""
    pieces = tok.backend.pre_tokenizer.pre_tokenize_str(text)
    return [bytes(BYTE_LEVEL_CHARS[c] for c in piece).decode() for piece, _ in pieces]


def regex_split(regexes: tuple[str, ...], text: str) -> list[str]:
    """llama.cpp's `unicode_regex_split` with the `regex` module: each regex in turn cuts every piece
    the one before left into its matches and the text between them."""
    pieces = [text]
    for expr in regexes:
        out: list[str] = []
        for piece in pieces:
            at = 0
            for m in regex.finditer(expr, piece):
                out += [s for s in (piece[at:m.start()], m.group()) if s]
                at = m.end()
            out += [piece[at:]] if at < len(piece) else []
        pieces = out
    return pieces


def test_qwen35_keeps_combining_marks_in_words(tmp_path: Path) -> None:
    """Qwen3.5's converter writes pre "qwen35" (llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN35): marks join
    the letters before them, where Qwen2's regex cuts decomposed accents and Devanagari vowel signs off."""
    text = "cafe\u0301 na\u0308ive \u0915\u093f\u0924\u093e\u092c"
    assert pre_tokenize(bpe_vocab(tmp_path, "qwen35"), text) == ["cafe\u0301", " na\u0308ive",
                                                                 " \u0915\u093f\u0924\u093e\u092c"]
    assert len(pre_tokenize(bpe_vocab(tmp_path, "qwen2"), text)) == 7


@pytest.mark.parametrize("name", sorted(EXPECTED_SPLITS))
def test_pre_tokenizer_splits_as_llama_cpp(tmp_path: Path, name: str) -> None:
    tok = bpe_vocab(tmp_path, name)
    for text, expected in zip(SPLIT_SAMPLES, EXPECTED_SPLITS[name], strict=True):
        assert pre_tokenize(tok, text) == expected, text


@pytest.mark.parametrize("name", sorted(PRE_TOKENIZERS))
def test_pre_tokenizer_regexes_split_as_the_regex_module_does(tmp_path: Path, name: str) -> None:
    """Every table entry compiles in `tokenizers` and cuts as its regexes do under Python's `regex`."""
    tok = bpe_vocab(tmp_path, name)
    regexes = pre_tokenizer(name).regexes
    for text in SPLIT_SAMPLES:
        expected = regex_split(regexes, text)
        assert len(expected) > 1 and "".join(expected) == text  # the sample does get split
        assert pre_tokenize(tok, text) == expected, text


def test_smollm2_pre_tokenizer_pins_the_golden_splits(smollm2: Tokenizer, tokenizer_goldens: list[dict]) -> None:
    """BPE merges never cross a piece boundary, so each cut must fall between two of the ids llama.cpp
    gave: a split that cuts where llama.cpp does not fails here (one that cuts too little fails the
    goldens and the tables above)."""
    plain = [case for case in tokenizer_goldens if not set(case["ids"]) & smollm2.special_ids]
    assert len(plain) > 10
    for case in plain:
        cuts, at = set(), 0
        for piece in pre_tokenize(smollm2, case["text"]):
            at += len(piece.encode())
            cuts.add(at)
        ends, at = set(), 0
        for i in case["ids"]:
            at += len(smollm2.token_bytes(i))
            ends.add(at)
        assert cuts <= ends, case["text"]


def test_pre_tokenizer_default_when_unnamed() -> None:
    assert pre_tokenizer(None) is pre_tokenizer("default") is not None
