"""Record forms: what a pool example and a target pair are once read and validated.

A *prompt* is either plain text or a list of chat messages
(``[{"role": "user", "content": "..."}, ...]``); tokenisation renders it with the
tokenizer's chat template when there is one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

Prompt = Union[str, list]  # text, or a list of {"role", "content"} messages


@dataclass
class PoolExample:
    """One candidate SFT example ``z = (x, y)``.

    ``id`` is the record's ``id`` field when present, else its 0-based row number.
    ``row`` is the 0-based record index in the source file.
    """

    id: Any
    prompt: Prompt
    response: str
    row: int


@dataclass
class TargetPair:
    """One paired target example ``(q, y+, y-)``: ``chosen`` is the target-positive
    response ``y+``, ``rejected`` the target-negative contrast ``y-``. ``task`` groups
    pairs for methods that aggregate per task (LESS); ``None`` means one task."""

    id: Any
    prompt: Prompt
    chosen: str
    rejected: str
    row: int
    task: str | None = None


@dataclass
class InvalidRecord:
    """A record skipped under ``--skip-invalid``: where it was and why."""

    path: str
    row: int
    field: str | None
    reason: str

    def to_json(self) -> dict:
        return {"path": self.path, "row": self.row, "field": self.field, "reason": self.reason}


@dataclass
class Loaded:
    """The result of reading a pool or a target file."""

    path: str
    format: str
    items: list = field(default_factory=list)  # PoolExample or TargetPair
    invalid: list = field(default_factory=list)  # InvalidRecord
