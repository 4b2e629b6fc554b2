"""What the builders of every family share: the distractor text and the record writer."""

from __future__ import annotations

import random

from ...io import atomic_write_jsonl


def shuffle_words(text: str, rng: random.Random) -> str:
    """``text`` with its words in another seeded order: a distractor pair's chosen response,
    which the model strongly disprefers (a text of one word: that word twice)."""
    words = text.split()
    if len(set(words)) < 2:
        return text + " " + text
    for _ in range(20):
        w = list(words)
        rng.shuffle(w)
        if w != words:
            return " ".join(w)
    return " ".join(reversed(words))


def write_records(path, records) -> int:
    """Write records as JSON Lines, atomically."""
    return atomic_write_jsonl(path, records)
