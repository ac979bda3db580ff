"""A vocabulary-only Gemma 4 GGUF, written as llama.cpp's converter writes one (`Gemma4Model.set_vocab`):
tokenizer model "gemma4", "▁" for spaces, `<0xXX>` byte tokens, ranked merges, the chat markers as
USER_DEFINED tokens and the turn markers as CONTROL ones, and the real chat template. Small enough
to reason about token by token: printable ASCII, "▁", "\\n" and a few merges, so any text encodes
(characters outside it fall back to bytes)."""

from __future__ import annotations

from pathlib import Path

import gguf

from tests.conftest import TEMPLATES

CONTROL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>", "<|think|>", "<|tool>",
                  "<tool|>"]
VISIBLE_TOKENS = ["<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>",
                  "<tool_response|>", '<|"|>']  # USER_DEFINED: rendered as text, so the parsers see them
CHARS = ["▁", "\n", *(chr(c) for c in range(33, 127))]
MERGES = ["▁ t", "h e", "▁t he", "\n \n", "i n", "▁ a"]
NEWLINES = "\n\n\n"  # a token no merge builds: llama.cpp takes a newline run that is a token whole


def tokens_and_types() -> tuple[list[str], list[int]]:
    merged = [m.replace(" ", "") for m in MERGES]
    tokens = [*CONTROL_TOKENS, *VISIBLE_TOKENS, *(f"<0x{b:02X}>" for b in range(256)), *CHARS, *merged, NEWLINES]
    types = ([gguf.TokenType.CONTROL] * len(CONTROL_TOKENS) + [gguf.TokenType.USER_DEFINED] * len(VISIBLE_TOKENS)
             + [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.NORMAL] * (len(CHARS) + len(merged) + 1))
    return tokens, [int(t) for t in types]


def write_gemma4_vocab(path: Path, template: str = "gemma-4.jinja", add_bos: bool = True) -> Path:
    tokens, types = tokens_and_types()
    writer = gguf.GGUFWriter(path, "gemma4")
    writer.add_tokenizer_model("gemma4")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types(types)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(tokens.index("<bos>"))
    writer.add_eos_token_id(tokens.index("<eos>"))
    writer.add_pad_token_id(tokens.index("<pad>"))
    writer.add_unk_token_id(tokens.index("<unk>"))
    writer.add_add_space_prefix(False)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template((TEMPLATES / template).read_text())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
