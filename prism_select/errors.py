"""Errors raised by prism-select.

Every error a user can meet is a :class:`PrismError`. Input errors name the file, the
row (0-based record number, or line for JSON Lines), the field, what was expected and
how to fix it, so a data-curation run never ends on a bare traceback.
"""

from __future__ import annotations


class PrismError(Exception):
    """Base class of every error prism-select raises on purpose."""


class InputError(PrismError):
    """A data file or record is malformed.

    Attributes name where the problem is so that callers (and ``--skip-invalid``)
    can report it: ``path``, ``row`` (0-based record index; ``None`` for a whole-file
    problem), ``field`` and ``fix``.
    """

    def __init__(self, message: str, *, path=None, row=None, field=None, fix=None):
        self.path = None if path is None else str(path)
        self.row = row
        self.field = field
        self.fix = fix
        self.reason = message
        where = []
        if self.path is not None:
            where.append(self.path)
        if row is not None:
            where.append(f"row {row}")
        if field is not None:
            where.append(f"field '{field}'")
        text = (": ".join([", ".join(where), message]) if where else message)
        if fix:
            text += f" (fix: {fix})"
        super().__init__(text)

    def at(self, path, row) -> "InputError":
        """The same error, located at ``path``, ``row`` (record parsers raise unlocated)."""
        return InputError(self.reason, path=path, row=row, field=self.field, fix=self.fix)


class ConfigError(PrismError):
    """A settings value is invalid; the message names the field and the fix."""

    def __init__(self, field: str, message: str, fix: str | None = None):
        self.field = field
        text = f"setting '{field}': {message}"
        if fix:
            text += f" (fix: {fix})"
        super().__init__(text)


class ModelError(PrismError):
    """A model, tokenizer or adapter cannot be loaded or does not fit."""


class NumericalError(PrismError):
    """NaN or inf appeared in a loss, gradient or curvature factor."""


class CacheError(PrismError):
    """A cache or output directory cannot be (re)used as asked."""


class OutputError(PrismError):
    """An output cannot be written (unwritable directory, full disk, existing run)."""
