"""Output helpers shared by every command: atomic writes and fingerprints.

Every output is written to a temporary file in the destination's own directory and
moved into place with :func:`os.replace`, so an interrupted or failed run never leaves
a half-written file where a finished one is expected (and a reader never sees one).
The temporary file is removed on any exception. OS-level failures become
:class:`~prism_select.errors.OutputError` naming the path and the cause.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from .errors import CacheError, ConfigError, InputError, OutputError

# mkstemp/mkdtemp create private (0600/0700) entries; give outputs the usual mode.
_UMASK = os.umask(0)
os.umask(_UMASK)


#: this process in the names of its temporary files (``.<name>.<pid>-<host>.XXXXXXXX.tmp``),
#: so that a later run can tell the files of a killed writer from a live one's
_HOST = hashlib.sha256(os.uname().nodename.encode() if hasattr(os, "uname") else b"").hexdigest()[:6]
#: a temporary file of another host (or of an older name form) is stale after this long
STALE_TEMP_S = 24 * 3600


def _temp_prefix(path: Path) -> str:
    return f".{path.name}.{os.getpid()}-{_HOST}."


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def remove_stale_temps(path: str | os.PathLike) -> list:
    """Remove the temporary files (and folders) an atomic write of ``path`` left when its
    process was killed (SIGKILL, a crash, the machine going down): those of a process of
    this host that is gone, and any older than :data:`STALE_TEMP_S`. A live writer's are
    kept. Returns the removed paths."""
    path = Path(path)
    pattern = re.compile(rf"^\.{re.escape(path.name)}\.(?:(\d+)-([0-9a-f]{{6}})\.)?[A-Za-z0-9_]{{8}}\.tmp$")
    removed = []
    try:
        candidates = list(path.parent.iterdir()) if path.parent.is_dir() else []
    except OSError:
        return removed
    now = time.time()
    for p in candidates:
        m = pattern.match(p.name)
        if m is None:
            continue
        try:
            old = now - os.lstat(p).st_mtime > STALE_TEMP_S
        except OSError:
            continue
        dead = m.group(1) is not None and m.group(2) == _HOST and not _alive(int(m.group(1)))
        if not (dead or old):
            continue
        with contextlib.suppress(OSError):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
            removed.append(p)
    return removed


def _fail(path, e: OSError) -> OutputError:
    cause = e.strerror or str(e)
    return OutputError(f"cannot write {path}: {cause}")


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, binary: bool = False) -> Iterator[IO]:
    """Open a temporary file next to ``path``; on a clean exit it replaces ``path``.

    Creates missing parent directories. On any exception the temporary file is removed
    and the exception re-raised (``OSError`` as :class:`OutputError`).
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_temp_prefix(path), suffix=".tmp")
    except OSError as e:
        raise _fail(path, e) from e
    try:
        # Lone surrogates (legal in JSON input, not in UTF-8) are written as "\udxxx",
        # which inside a JSON string is the escape that reads back as the same text.
        mode = {"mode": "wb"} if binary else {"mode": "w", "encoding": "utf-8", "newline": "",
                                               "errors": "backslashreplace"}
        with os.fdopen(fd, **mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise _fail(path, e) from e
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    with atomic_open(path) as f:
        f.write(text)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically."""
    with atomic_open(path, binary=True) as f:
        f.write(data)


def _dumps(obj: Any, path, **kw) -> str:
    try:
        return json.dumps(obj, ensure_ascii=False, **kw)
    except (TypeError, ValueError, RecursionError) as e:
        raise OutputError(f"cannot write {path}: value is not JSON-serialisable ({e})") from e


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as indented JSON (key order kept, trailing newline) atomically.

    The object is serialised before the file is opened, so a value that cannot be
    serialised leaves nothing behind.
    """
    atomic_write_text(path, _dumps(obj, path, indent=2, sort_keys=False) + "\n")


def atomic_write_jsonl(path: str | os.PathLike, rows: Iterable[dict],
                       default: Callable[[Any], Any] | None = None) -> int:
    """Write one JSON object per line atomically, streaming ``rows``; returns the count.

    ``default`` is passed to :func:`json.dumps` for values JSON has no type for. An
    exception raised by ``rows`` itself (e.g. a reader finding a bad record) aborts the
    write, removes the temporary file and propagates unchanged.
    """
    n = 0
    with atomic_open(path) as f:
        for row in rows:
            f.write(_dumps(row, path, default=default) + "\n")
            n += 1
    return n


def atomic_write_dir(path: str | os.PathLike, fill: Callable[[Path], None]) -> None:
    """Build a directory output atomically: ``fill(tmp)`` writes into a fresh temporary
    directory next to ``path``, which then takes ``path``'s place.

    An existing ``path`` is replaced only if it is an empty directory or a saved dataset
    (``state.json``/``dataset_info.json``), so a mistyped output path can never delete an
    unrelated directory.
    """
    path = Path(path)
    if path.exists() and not (path.is_dir() and (
            not any(path.iterdir()) or (path / "state.json").exists()
            or (path / "dataset_info.json").exists())):
        raise OutputError(f"cannot write {path}: it exists and is not a saved dataset "
                          "directory; refusing to replace it (choose another output path)")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=_temp_prefix(path), suffix=".tmp"))
    except OSError as e:
        raise _fail(path, e) from e
    old = None
    try:
        fill(tmp)
        os.chmod(tmp, 0o777 & ~_UMASK)
        if path.exists():
            old = path.with_name(f".{path.name}.{os.getpid()}.old")
            os.rename(path, old)
        os.rename(tmp, path)
    except BaseException as e:
        if old is not None and not path.exists():
            with contextlib.suppress(OSError):
                os.rename(old, path)
            old = None
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise _fail(path, e) from e
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def check_writable_dir(path: str | os.PathLike) -> Path:
    """Create ``path`` if needed and prove a file can be created and removed there.

    Call it before long work starts so that an unwritable output directory fails in
    seconds, not after hours of scoring.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputError(f"output directory {path} is a file, not a folder: the run's files go into a folder "
                          "(choose a new or existing folder as --out, or move the file away)")
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".write-probe.")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise OutputError(f"output directory {path} is not writable: "
                          f"{e.strerror or e}") from e
    return path


def read_saved_state(path: str | os.PathLike) -> dict:
    """The JSON object an unfinished run saved in its ``.partial`` (``key.json``,
    ``state.json``). A file that cannot be read, is cut short (a disk that failed, an edit)
    or holds no object is a :class:`CacheError` saying how to start over: the finished
    work beside it cannot be matched to its settings."""
    path = Path(path)
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        value, why = None, str(e)
    else:
        why = f"got {type(value).__name__ if value is not None else 'null'}, not an object"
    if not isinstance(value, dict):
        raise CacheError(f"the unfinished run's record {path} is damaged ({why}), so its finished work cannot be "
                         "matched to its settings; pass --overwrite to start the run again, or choose another --out")
    return value


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """Hex SHA-256 of a file's bytes (read in ``chunk``-byte blocks).

    For a directory (a saved dataset) it hashes every file's relative path and bytes,
    in sorted order, so a pool given as a directory has a fingerprint too.
    """
    h = hashlib.sha256()
    root = Path(path)
    try:
        files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
        for file in files:
            if file != root:
                h.update(file.relative_to(root).as_posix().encode() + b"\0")
            with open(file, "rb") as f:
                while block := f.read(chunk):
                    h.update(block)
    except OSError as e:
        raise InputError(f"cannot read: {e.strerror or e}", path=path) from e
    return h.hexdigest()


def canonical_json(obj: Any) -> str:
    """``obj`` as canonical JSON: sorted keys, no whitespace, ASCII, sets as sorted lists
    and anything else JSON lacks as its ``str``. Equal settings give equal text whatever
    their key order, and in every process: a set's iteration order (e.g. a PEFT config's
    ``target_modules``) follows the process's string-hash seed."""
    def default(o):
        if isinstance(o, (set, frozenset)):
            return sorted(o, key=lambda x: json.dumps(x, sort_keys=True, default=default))
        return str(o)
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=default)


def sha256_json(obj: Any) -> str:
    """Hex SHA-256 of ``obj``'s :func:`canonical_json`."""
    return hashlib.sha256(canonical_json(obj).encode("ascii")).hexdigest()


def write_if_changed(path: Path, records: list) -> str:
    """Write records (JSON Lines) unless the file already holds exactly them; return the sha256."""
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    if not (path.is_file() and sha256_file(path) == digest):
        atomic_write_jsonl(path, records)
    return digest


def check_path_name(field: str, value, label: str | None = None) -> None:
    """A path with a name longer than its file system allows (ENAMETOOLONG), or longer than
    a path may be, is a :class:`ConfigError` naming ``field`` (shown as ``label``: the CLI
    passes its flag), before anything is read or created. Non-text values pass."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value:
        return
    label = label or field
    if len(os.fsencode(value)) >= _path_limit("PC_PATH_MAX", value, 4096):
        raise ConfigError(field, f"{label} is {len(value)} characters long, longer than a path may be here",
                          "choose a shorter path")
    limit = _path_limit("PC_NAME_MAX", value, 255)
    long = [part for part in value.split(os.sep) if len(os.fsencode(part)) > limit]
    if long:
        raise ConfigError(field, f"{label} holds a name of {len(long[0])} characters ({long[0][:40]}...), longer "
                          f"than the {limit} this file system allows (ENAMETOOLONG)", "choose a shorter name")


def _path_limit(what: str, value: str, default: int) -> int:
    """``os.pathconf`` of the nearest existing folder of ``value`` (``default`` where unknown)."""
    d = os.path.dirname(os.path.abspath(value))
    while d and not os.path.isdir(d):
        parent = os.path.dirname(d)
        if parent == d:
            break
        d = parent
    try:
        return os.pathconf(d or "/", what)
    except (OSError, ValueError, AttributeError):
        return default
