"""The on-disk cache: one root, one folder per kind of artifact, one entry per key.

    <root>/curvature/<key>/   fitted curvature (curvature.json + factors*.safetensors)
    <root>/models/<key>/      converted GGUF models (prism_cache.json + model.safetensors)
    <root>/less/<key>/        LESS warm-up adapters
    <root>/generations/<key>/ ProjDiff's sampled own responses (responses.jsonl, appended)

An entry is a folder that the cache itself made: its first file, written when the
folder is made, is the entry marker :data:`ENTRY_MARKER` (the cache's name, its layout
format and the entry's kind), and the cache's root holds :data:`ROOT_MARKER`. Nothing
is ever removed from a folder without its entry marker: ``list`` shows such a folder as
*foreign* (not written by prism-select) or *unmarked* (it holds a kind's content marker:
an entry written before entry markers existed), and ``prune``, ``clear`` and eviction
leave it alone; it is removed by hand (``rm -r``). Links are never followed below the
root: a kind folder or an entry that is a symbolic link is listed as a link and never
read, counted or removed through (the root itself may be a link: it is the folder the
user named). :func:`check_root` refuses a folder that is no cache.

An entry is *complete* once its kind's marker file (written last, atomically)
exists and holds a JSON object, so a killed writer (or a damaged marker) leaves an
incomplete entry that is never read and that ``prune`` removes. Reading an entry
touches its marker: the marker's modification time is the entry's last use, which
orders eviction (least recently used first). An entry being written is locked
(:func:`writing`, a ``flock`` on ``<kind>/.<name>.lock``); eviction skips a locked entry.

:func:`make_room` evicts entries until a new one of a given size fits under
``max_bytes`` (``--cache-max-gb``) and on the disk. :func:`guarded_write` runs a writer
and turns a failure to write (disk full, read-only, quota) into a warning and a removed
partial entry: the run goes on with what it holds in memory. ``prism-select cache
list | prune | clear`` is built on :func:`entries`, :func:`prune` and :func:`clear`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from . import locks
from .errors import CacheError
from .settings import format_size

log = logging.getLogger(__name__)

#: marker file of a complete entry, by kind (other kinds: any of these)
MARKERS = {"curvature": "curvature.json", "models": "prism_cache.json", "less": "less_warmup.json",
           "generations": "generations.json"}
#: the kinds of entry, each a folder under the root
KINDS = tuple(MARKERS)
#: the file in each entry folder that says the cache made it (written when the folder is made)
ENTRY_MARKER = ".prism-select-entry.json"
#: the file in the cache's root that says it is a prism-select cache
ROOT_MARKER = ".prism-select-cache.json"
#: the cache's name in both markers
CACHE_NAME = "prism-select"
#: the layout's format, recorded in both markers
LAYOUT_FORMAT = 1
#: free disk space kept after a write, so the cache never fills the disk to the last byte
DISK_RESERVE_BYTES = 1 << 30
#: an entry evicted within this many seconds of its last use is named in a warning: the
#: bound is too small for the runs that share the cache, which will compute it again
RECENT_USE_S = 3600
#: how a folder that the cache leaves alone is removed, said by ``cache list``
BY_HAND = "remove it by hand if it is not needed (rm -r PATH)"


@dataclass
class Entry:
    kind: str
    path: Path
    size: int  # bytes on disk
    last_used: float  # seconds since the epoch (the marker's mtime; the folder's if incomplete)
    complete: bool

    def to_json(self) -> dict:
        return {"kind": self.kind, "path": str(self.path), "size": self.size,
                "last_used": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.last_used)),
                "complete": self.complete}


@dataclass
class Unmanaged:
    """A folder under the root that the cache lists but never removes. why: ``link`` (a
    symbolic link), ``unmarked`` (an entry written before entry markers existed: it holds
    its kind's content marker) or ``foreign`` (not written by prism-select)."""

    path: Path
    why: str


def _marker(kind: str, d: Path) -> Path | None:
    names = [MARKERS[kind]] if kind in MARKERS else list(MARKERS.values())
    for n in names:
        if (d / n).exists():
            return d / n
    return None


def _readable(marker: Path) -> bool:
    """Whether a marker holds a JSON object (a truncated one leaves the entry incomplete)."""
    try:
        return isinstance(json.loads(marker.read_text(encoding="utf-8")), dict)
    except (OSError, ValueError):
        return False


def _is_link(p: Path) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(p).st_mode)
    except OSError:
        return False


def _is_real_dir(p: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(p).st_mode)
    except OSError:
        return False


def _read_marker(f: Path) -> dict | None:
    """A marker's JSON object, read without following a link; None if it is none."""
    try:
        fd = os.open(f, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as fh:
            value = json.loads(fh.read(1 << 16).decode("utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) and value.get("cache") == CACHE_NAME \
        and isinstance(value.get("format"), int) else None


def _write_marker(f: Path, body: dict) -> None:
    """Write a marker atomically (a temporary file renamed over it); ``OSError`` on failure."""
    tmp = f.with_name(f"{f.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump({"cache": CACHE_NAME, "format": LAYOUT_FORMAT, **body}, fh)
            fh.write("\n")
        os.replace(tmp, f)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def owned(entry_dir) -> bool:
    """Whether ``entry_dir`` is an entry this cache made: a real folder (not a link) in a
    real kind folder, holding the entry marker of its kind."""
    d = Path(entry_dir)
    if d.parent.name not in KINDS or not _is_real_dir(d.parent) or not _is_real_dir(d):
        return False
    m = _read_marker(d / ENTRY_MARKER)
    return m is not None and m.get("kind") == d.parent.name


def claim(entry_dir) -> Path:
    """Make ``entry_dir`` (``<root>/<kind>/<name>``) an entry of the cache: create it (and
    the root's marker where missing) and write its entry marker first, before any of its
    content, so that even a writer killed at once leaves an entry the cache may prune.
    Raises ``OSError`` (or :class:`~prism_select.errors.OutputError`) where it cannot."""
    d = Path(entry_dir)
    kind, root = d.parent.name, d.parent.parent
    if kind not in KINDS:
        raise ValueError(f"{d} is not under a cache kind folder ({', '.join(KINDS)})")
    if _is_link(d):
        raise OSError(errno.ELOOP, "the cache entry is a symbolic link; refusing to write through it", str(d))
    d.mkdir(parents=True, exist_ok=True)
    mark_root(root)
    if _read_marker(d / ENTRY_MARKER) is None:
        _write_marker(d / ENTRY_MARKER, {"kind": kind})
    return d


def mark_root(root) -> None:
    """Write the root's marker unless it is there (the cache's first entry writes it)."""
    f = Path(root) / ROOT_MARKER
    if _read_marker(f) is None:
        _write_marker(f, {})


def check_root(root) -> str:
    """What ``root`` is: ``"cache"`` (its marker is there), ``"legacy"`` (no root marker,
    but a kind folder holds an entry with its kind's content marker: a cache written
    before markers existed, whose entries are listed as unmarked and never removed) or
    ``"empty"`` (missing, or holding nothing but empty kind folders). Anything else is
    refused with a :class:`~prism_select.errors.CacheError` naming the folder."""
    root = Path(root)
    if not root.exists():
        return "empty"
    if _read_marker(root / ROOT_MARKER) is not None:
        return "cache"
    held = []
    for p in root.iterdir():
        if p.name in KINDS and _is_real_dir(p):
            kids = list(p.iterdir())
            if any(_is_real_dir(k) and _marker(p.name, k) is not None for k in kids):
                return "legacy"
            if not kids:
                continue
        held.append(p.name)
    if not held:
        return "empty"
    raise CacheError(f"{root} is not a prism-select cache (it has no {ROOT_MARKER}, and none of its folders is a "
                     f"cache entry; it holds {', '.join(sorted(held)[:5])}{', ...' if len(held) > 5 else ''}); "
                     "refusing to list or remove anything in it: pass the cache folder as --cache-dir (prism-select "
                     "cache list without --cache-dir shows the default one)")


def dir_size(d: Path) -> int:
    total = 0
    for root, _, files in os.walk(d):  # links are not followed
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def scan(root) -> tuple[list, list]:
    """``(entries, unmanaged)``: the cache's own entries under ``root``, least recently
    used first, and the folders it lists but never removes (:class:`Unmanaged`). Only the
    kind folders (:data:`KINDS`) hold entries; other folders at the root are foreign."""
    root = Path(root)
    out, other = [], []
    if not root.is_dir():
        return out, other
    for p in sorted(root.iterdir()):
        if p.name.startswith(".") or p.name in KINDS:
            continue
        if _is_link(p):
            other.append(Unmanaged(p, "link"))
        elif _is_real_dir(p):
            other.append(Unmanaged(p, "foreign"))
    for kind in KINDS:
        kind_dir = root / kind
        if _is_link(kind_dir):
            other.append(Unmanaged(kind_dir, "link"))
            continue
        if not _is_real_dir(kind_dir):
            continue
        for d in sorted(kind_dir.iterdir()):
            if _is_link(d):
                other.append(Unmanaged(d, "link"))
                continue
            if not _is_real_dir(d):
                continue
            m = _marker(kind, d)
            if not owned(d):
                other.append(Unmanaged(d, "unmarked" if m is not None else "foreign"))
                continue
            try:
                used = (m or d).stat().st_mtime
            except OSError:
                continue
            out.append(Entry(kind, d, dir_size(d), used,
                             m is not None and not d.name.startswith(".") and _readable(m)))
    return sorted(out, key=lambda e: e.last_used), other


def entries(root) -> list:
    """Every entry the cache made under ``root``, least recently used first (:func:`scan`)."""
    return scan(root)[0]


def touch(entry_dir) -> None:
    """Mark an entry as used now (its marker's mtime)."""
    d = Path(entry_dir)
    m = _marker(d.parent.name, d)
    if m is not None:
        try:
            os.utime(m)
        except OSError:
            pass


def lock_path(entry_dir) -> Path:
    """The lock file of an entry: ``<kind>/.<name>.lock``, beside it."""
    d = Path(entry_dir)
    return d.parent / f".{d.name}.lock"


def writing(entry_dir, timeout_s: float | None = None):
    """Hold the entry's write lock (:mod:`prism_select.locks`), waiting for another writer
    of the same entry; creates the kind folder. Eviction skips an entry while it is held."""
    Path(entry_dir).parent.mkdir(parents=True, exist_ok=True)
    return locks.held(lock_path(entry_dir), wait=True, timeout_s=timeout_s)


def remove(entry_dir, held: bool = False) -> bool:
    """Remove an entry the cache made (:func:`owned`) and no process is writing, never
    through a link: the kind folder is opened without following one, and the entry is
    removed relative to it. A folder without the entry marker is left alone (an empty one
    is removed). ``held``: the caller holds the entry's write lock. Returns whether it was
    removed."""
    d = Path(entry_dir)
    if not owned(d):
        if _is_real_dir(d) and _is_real_dir(d.parent):
            with contextlib.suppress(OSError):
                d.rmdir()  # only when empty: a writer that failed before its marker
        return False
    if not held and locks.is_held(lock_path(d)):
        log.info("not removing %s: a process is writing it", d)
        return False
    try:
        fd = os.open(d.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        shutil.rmtree(d.name, dir_fd=fd)  # refuses a link; removes links inside as links
    except OSError as exc:
        log.warning("could not remove the cache entry %s: %s", d, exc)
        return False
    finally:
        os.close(fd)
    return True


def prune(root, max_bytes: int | None = None, keep=(), incomplete_age_s: float = 3600) -> list:
    """Remove incomplete entries older than ``incomplete_age_s``, then the least recently
    used complete ones until the cache holds at most ``max_bytes`` (None: no bound).
    ``keep``: entry folders never removed. Only the cache's own entries are removed
    (:func:`scan`). Returns the removed entries."""
    keep = {Path(k).resolve() for k in keep}
    now = time.time()
    removed = []
    live = []
    for e in entries(root):
        if e.path.resolve() in keep:
            live.append(e)
        elif not e.complete and now - e.last_used > incomplete_age_s and remove(e.path):
            removed.append(e)
        else:
            live.append(e)
    if max_bytes is not None:
        total = sum(e.size for e in live)
        for e in live:
            if total <= max_bytes:
                break
            if e.path.resolve() in keep or not e.complete:
                continue
            if remove(e.path):
                removed.append(e)
                total -= e.size
    return removed


def clear(root, kind: str | None = None) -> list:
    """Remove every entry the cache made (of ``kind``, if given)."""
    return [e for e in entries(root) if (kind is None or e.kind == kind) and remove(e.path)]


def make_room(root, need: int, max_bytes: int | None = None, keep=()) -> bool:
    """Evict least recently used entries so that ``need`` more bytes fit under ``max_bytes``
    and on the disk (keeping DISK_RESERVE_BYTES free). False if that is impossible (the
    entry is larger than the bound, or the disk is too small even with the cache empty).
    Entries evicted within :data:`RECENT_USE_S` of their last use are named in a warning."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    if max_bytes is not None:
        if need > max_bytes:
            return False
        _warn_recent(prune(root, max_bytes - need, keep=keep), root,
                     f"--cache-max-gb {max_bytes / (1 << 30):.3g}")
    evicted = []
    try:
        for e in entries(root):
            if shutil.disk_usage(root).free - DISK_RESERVE_BYTES >= need:
                return True
            if e.complete and e.path.resolve() not in {Path(k).resolve() for k in keep} and remove(e.path):
                evicted.append(e)
        return shutil.disk_usage(root).free - DISK_RESERVE_BYTES >= need
    finally:
        _warn_recent(evicted, root, "the free disk space")


def _warn_recent(evicted: list, root: Path, bound: str) -> None:
    """Warn when eviction removed complete entries used within :data:`RECENT_USE_S`: runs
    that share this cache (other methods or target sets on the same pool, the split-half
    check's half fits, runs side by side) will compute them again."""
    recent = [e for e in evicted if e.complete and time.time() - e.last_used <= RECENT_USE_S]
    if recent:
        log.warning("the cache under %s evicted %d entr%s used in the last %d minutes (%s) to stay within %s: "
                    "runs that share it will compute them again. Fix: raise --cache-max-gb to what the runs "
                    "sharing this cache hold together (a fitted curvature and the split-half check's two half "
                    "fits per pool and curvature setting), run fewer of them at once, or give each its own "
                    "--cache-dir", root, len(recent), "y" if len(recent) == 1 else "ies", RECENT_USE_S // 60,
                    format_size(sum(e.size for e in recent)), bound)


def guarded_write(entry_dir, write, what: str, lock: bool = True) -> bool:
    """Claim ``entry_dir`` (:func:`claim`: its entry marker first) and run ``write()``
    (which fills it) holding its write lock (``lock``; a collective write locks on one
    process only); on a failure to write (OSError, or a writer's own error wrapping one),
    remove the partial entry, warn, and return False."""
    try:
        with writing(entry_dir) if lock else contextlib.nullcontext():
            try:
                claim(entry_dir)
                write()
                return True
            except Exception as exc:  # safetensors raises its own error type for a full disk
                if not (isinstance(exc, OSError) or "No space left" in str(exc) or "Errno" in str(exc)
                        or type(exc).__name__ in ("SafetensorError", "OutputError")):
                    raise
                remove(entry_dir, held=True)
                log.warning("could not save %s in the cache (%s): the run goes on with it in memory; free disk "
                            "space or set --cache-dir / --cache-max-gb to keep it next time", what, exc)
                return False
    except OSError as exc:  # the lock file itself cannot be made
        log.warning("could not save %s in the cache (%s): the run goes on with it in memory", what, exc)
        return False
