"""Errors raised by prism-select.

Every error a user can meet is a :class:`PrismError`. Input errors name the file, the
line (JSON Lines and CSV: the line number an editor shows) or row (other formats: the
record's number, counted from 1), the field, what was expected and how to fix it, so a
data-curation run never ends on a bare traceback.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path


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


class OutOfResourceError(PrismError):
    """The run ran out of device memory, host memory or disk space (``resource``: ``gpu
    memory``, ``host memory`` or ``disk``). The message says what ran out, what finished
    work is kept and where, and what to change; the same command then resumes from the
    kept work (finished score chunks and a saved direction in ``<out>/.partial``, the
    fitted curvature in the cache)."""

    def __init__(self, resource: str, message: str, fix: str, kept: str):
        self.resource, self.fix, self.kept = resource, fix, kept
        super().__init__(f"out of {resource}: {message}. Kept: {kept}. Fix: {fix}, then run the same command "
                         "again: it resumes from the kept work")


#: errno values of a write that found no room (disk full, quota exceeded)
_NO_SPACE = {28, 122}  # ENOSPC, EDQUOT


def _no_space(exc: BaseException) -> bool:
    if isinstance(exc, OSError):
        return exc.errno in _NO_SPACE
    text = str(exc)  # safetensors wraps the OS error in its own type
    return type(exc).__name__ == "SafetensorError" and (
        "No space left" in text or "StorageFull" in text or "os error 28" in text or "code: 28" in text)


def _kept(out_dir, curvature=None) -> str:
    partial = Path(out_dir) / ".partial"
    chunks = len(list(partial.rglob("chunk_*.safetensors"))) if partial.is_dir() else 0
    direction = partial.is_dir() and any(partial.glob("*_v*.safetensors"))
    parts = []
    if chunks:
        parts.append(f"{chunks} finished score chunk(s) in {partial}")
    if direction:
        parts.append(f"the preconditioned direction in {partial}")
    if curvature:
        parts.append(f"the fitted curvature in {curvature} (reused)")
    return "; ".join(parts) or "nothing had finished yet"


def _oom_text(text: str) -> str:
    """The parts of a CUDA out-of-memory message that say what ran out: its first
    sentence (what it tried to allocate), this process's use and the cap it ran under
    (``set_per_process_memory_fraction``'s "allowed"); the other processes' use, which
    the caching allocator lists between them, is left out."""
    first = re.match(r"CUDA out of memory\.?(?:\s*Tried to allocate [\d.]+ \w+)?", text)
    parts = [(first.group(0) if first else (text.splitlines() or ["out of memory"])[0][:200]).rstrip(". ")]
    own = re.search(r"this process has ([\d.]+ \w+) memory in use", text)
    if own:
        parts.append(f"this process had {own.group(1)} in use")
    cap = re.search(r"with ([\d.]+ \w+) allowed", text)
    if cap:
        parts.append(f"{cap.group(1)} allowed")
    return "; ".join(parts)


#: why a CUDA-graph capture in this process ran out of memory, if one did (appended by
#: :mod:`prism_select.runtime.graphs`): the pool of a capture the allocator stopped stays held, so
#: later scorers of the process run eagerly and an out-of-memory error says what to change
CAPTURE_OOM: list = []


def capture_out_of_memory() -> str | None:
    """The error of a CUDA-graph capture that ran out of memory earlier in this process."""
    return CAPTURE_OOM[0] if CAPTURE_OOM else None


def resource_error(exc: BaseException, out_dir, curvature=None, stages=()) -> OutOfResourceError | None:
    """``exc`` as an :class:`OutOfResourceError` when it is an out-of-memory error (CUDA,
    MPS, or the host's ``MemoryError``) or a write that found the disk full; else None.
    ``out_dir``: the run's output directory (what is kept is read from its ``.partial``);
    ``curvature``: where the run's fitted curvature was saved, if it was; ``stages``: the
    run's finished stages, in order (the message names the stage it ran out after)."""
    import torch

    after = f" (after the stage {list(stages)[-1]!r} had finished)" if stages else ""
    text = (str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__) + after
    oom = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    if isinstance(exc, oom) or isinstance(exc, RuntimeError) and "out of memory" in str(exc):
        text = _oom_text(str(exc)) + after
        fix = "lower --batch-size, or cap the memory plan with --max-gpu-memory"
        if capture_out_of_memory():  # a lower cap would not help: the failed capture's pool is held
            fix = ("a CUDA-graph capture ran out of memory earlier in this process and its memory pool stays "
                   "held: rerun with --cuda-graphs off, or with a --max-gpu-memory that leaves the graphs room "
                   "above the plan's peak")
        return OutOfResourceError("GPU memory", text, fix, _kept(out_dir, curvature))
    if isinstance(exc, MemoryError):
        return OutOfResourceError("host memory", text or "MemoryError", "lower --batch-size, close other programs, "
                                  "or score with --stream", _kept(out_dir, curvature))
    if _no_space(exc):
        return OutOfResourceError("disk", text, f"free disk space under {out_dir} and the cache (prism-select "
                                  "cache prune), or write to another --out", _kept(out_dir, curvature))
    return None


def run_script(main) -> None:
    """Exit with ``main()``'s status; a :class:`PrismError` is printed as ``error: ...`` on
    stderr and exits 2 (the CLI's convention), for the scripts beside the package."""
    try:
        status = main()
    except PrismError as e:
        print(f"error: {e}", file=sys.stderr)
        status = 2
    sys.exit(status)
