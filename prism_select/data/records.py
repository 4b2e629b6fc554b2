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
    ``row`` is the 0-based record index in the source file; ``line`` its 1-based line
    in a JSON Lines or CSV file (None for other formats).
    """

    id: Any
    prompt: Prompt
    response: str
    row: int
    line: int | None = field(default=None, compare=False)  # where it is, not what it is


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
    line: int | None = field(default=None, compare=False)


@dataclass
class InvalidRecord:
    """A record skipped under ``--skip-invalid``: where it was and why."""

    path: str
    row: int
    field: str | None
    reason: str
    line: int | None = None  # 1-based, JSON Lines and CSV

    @classmethod
    def of(cls, err, path) -> "InvalidRecord":
        """The record an :class:`~prism_select.errors.InputError` names."""
        return cls(str(path), err.row, err.field, err.reason, getattr(err, "line", None))

    def to_json(self) -> dict:
        out = {"path": self.path, "row": self.row, "field": self.field, "reason": self.reason}
        return out if self.line is None else {**out, "line": self.line}


@dataclass
class Loaded:
    """The result of reading a pool or a target file."""

    path: str
    format: str
    items: list = field(default_factory=list)  # PoolExample or TargetPair
    invalid: list = field(default_factory=list)  # InvalidRecord
