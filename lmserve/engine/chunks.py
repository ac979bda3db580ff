"""How a prompt is cut into chunks (the scheduler's turns) and passes (an engine's forward passes)."""

from __future__ import annotations


def even_chunk(left: int, most: int) -> int:
    """The next chunk of the fewest chunks of at most `most` that `left` tokens take, evened out:
    1,157 tokens at most 1,024 go as 579 and 578, not 1,024 and a pass of 133 whose fixed costs
    (a MoE's experts unpacked for the tiles, a layer's Python, thread launches) its few rows
    share."""
    return -(-left // -(-left // max(1, most)))
