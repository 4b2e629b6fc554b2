"""Errors raised by prism-select.

Every error a user can meet is a :class:`PrismError`. Input errors name the file, the
line (JSON Lines and CSV: the line number an editor shows) or row (other formats: the
record's number, counted from 1), the field, what was expected and how to fix it, so a
data-curation run never ends on a bare traceback.
"""

from __future__ import annotations


class PrismError(Exception):
    """Base class of every error prism-select raises on purpose."""


class InputError(PrismError):
    """A data file or record is malformed.

    Attributes name where the problem is so that callers (and ``--skip-invalid``)
    can report it: ``path``, ``row`` (0-based record index, as default ids use it;
    ``None`` for a whole-file problem), ``line`` (1-based line of the record in a JSON
    Lines or CSV file, else ``None``), ``field`` and ``fix``. The message says
    ``line N`` when the line is known, else ``row N`` counted from 1.
    """

    def __init__(self, message: str, *, path=None, row=None, field=None, fix=None, line=None):
        self.path = None if path is None else str(path)
        self.row = row
        self.line = line
        self.field = field
        self.fix = fix
        self.reason = message
        where = []
        if self.path is not None:
            where.append(self.path)
        if line is not None:
            where.append(f"line {line}")
        elif row is not None:
            where.append(f"row {row + 1}")
        if field is not None:
            where.append(f"field '{field}'")
        text = (": ".join([", ".join(where), message]) if where else message)
        if fix:
            text += f" (fix: {fix})"
        super().__init__(text)

    def at(self, path, row, line=None) -> "InputError":
        """The same error, located at ``path``, ``row``, ``line`` (record parsers raise unlocated)."""
        return InputError(self.reason, path=path, row=row, field=self.field, fix=self.fix, line=line)


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
