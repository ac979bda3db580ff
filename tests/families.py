"""The tiny models of tests/data/fixtures/arch (one per family, made by llama.cpp itself) and
the acceptance figures every engine must reach on them (see that folder's README)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np

from tests.conftest import DATA

ARCH = DATA / "fixtures" / "arch"
FAMILIES = ("llama3", "qwen3moe", "gemma3", "phi3", "mistral", "qwen2", "gpt-oss",
            "qwen35", "qwen35moe", "gemma4", "gemma4-dense")
QUANTS = ("F16", "Q8_0", "Q4_K_M")


@dataclass(frozen=True)
class Fixture:
    family: str
    quant: str

    @property
    def path(self) -> Path:
        return ARCH / self.family / f"tiny-{self.family}-{self.quant}.gguf"

    @property
    def id(self) -> str:
        return f"{self.family}-{self.quant}"


def fixtures(quants: tuple[str, ...] = QUANTS) -> list[Fixture]:
    return [Fixture(f, q) for f in FAMILIES for q in quants]


@cache
def references(family: str) -> dict:
    """`token_ids`, `reference` (transformers, float32) and `llama_cpp` (per file) of a family."""
    return json.loads((ARCH / family / "logits.json").read_text())


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def check_against_references(fixture: Fixture, logits: np.ndarray) -> None:
    """`logits` `[64, vocab]`: every position of the family's token ids, prefilled at once.
    F16 files must agree with transformers' float32 top-1 at >= 63 of 64 positions (gpt-oss 62)
    with last-position cosine >= 0.999; quantized files with llama.cpp's top-1 at >= 56."""
    refs = references(fixture.family)
    top1 = logits.argmax(axis=-1).tolist()
    if fixture.quant == "F16":
        expected, floor = refs["reference"]["top1"], 62 if fixture.family == "gpt-oss" else 63
        assert cosine(logits[-1], refs["reference"]["last_logits"]) >= 0.999
    else:
        expected, floor = refs["llama_cpp"][fixture.path.name]["top1"], 56
    agree = sum(a == b for a, b in zip(top1, expected, strict=True))
    assert agree >= floor, f"{fixture.id}: top-1 agrees at {agree}/64 positions (floor {floor})"
