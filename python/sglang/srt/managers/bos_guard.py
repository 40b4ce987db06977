"""BOS guard: exactly one BOS at the start of every prompt whose tokenizer adds one.

A production tokenizer once dropped the BOS token of a 200K-token prompt and the model's
output fell apart; chat templates that spell out BOS while the tokenizer also adds it give
two. Both are mended here, for text, chat and input_ids prompts alike, at any length.
"""

from __future__ import annotations

from typing import List, Optional


def tokenizer_adds_bos(tokenizer) -> Optional[int]:
    """The BOS id if encoding plain text with special tokens adds it, else None."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return bos if ids and ids[0] == bos else None


def guard_bos(ids: List[int], bos_id: Optional[int]) -> List[int]:
    if bos_id is None:
        return ids
    start = 0
    while start < len(ids) and ids[start] == bos_id:
        start += 1
    if start == 1:
        return ids
    return [bos_id] + ids[start:]


def encode_with_bos_guard(tokenizer, text: str, bos_id: Optional[int]) -> List[int]:
    # No truncation ever: a silently truncated long prompt is how BOS got lost.
    ids = tokenizer(text, add_special_tokens=True, truncation=False)["input_ids"]
    return guard_bos(ids, bos_id)
