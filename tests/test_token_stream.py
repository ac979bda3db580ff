"""UTF-8-safe streaming and stop strings, on synthetic token byte tables."""

from __future__ import annotations

import pytest

from lmserve.chat.token_stream import TokenStream

pytestmark = pytest.mark.fast  # in-process: part of `scripts/test.sh -m fast`

EMOJI = "🙂".encode()  # 4 bytes, split over two tokens below
TABLE = {0: b"Hello", 1: b" wor", 2: b"ld", 3: EMOJI[:2], 4: EMOJI[2:], 5: b"<|", 6: b"end", 7: b"|>", 8: b"!"}


def run(ids: list[int], stop: list[str] = ()) -> tuple[list[str], TokenStream]:
    stream = TokenStream(TABLE.__getitem__, stop)
    out = []
    for i in ids:
        delta = stream.push(i)
        if delta:
            out.append(delta.text)
        if stream.stopped:
            break
    tail = stream.flush()
    if tail:
        out.append(tail.text)
    return out, stream


def test_split_emoji_is_released_whole():
    out, _ = run([0, 3, 4, 8])
    assert out == ["Hello", "🙂", "!"]
    assert all("\ufffd" not in piece for piece in out)


def test_stop_string_split_across_tokens_never_leaks():
    out, stream = run([0, 1, 5, 6, 7, 8], stop=["<|end|>"])
    assert "".join(out) == "Hello wor"
    assert stream.stop_sequence == "<|end|>"
    assert not any("<" in piece for piece in out)


def test_held_prefix_is_released_when_it_stops_matching():
    out, stream = run([0, 5, 8], stop=["<|end|>"])
    assert "".join(out) == "Hello<|!"
    assert stream.stop_sequence is None
    assert out[0] == "Hello"  # "<|" was held back until "!" proved it was not a stop


def test_earliest_stop_wins_and_text_before_it_is_kept():
    out, stream = run([0, 1, 2], stop=["ld", "o w"])
    assert "".join(out) == "Hell"
    assert stream.stop_sequence == "o w"


def test_partial_character_at_the_end_becomes_replacement():
    out, _ = run([0, 3])
    assert "".join(out) == "Hello\ufffd"
