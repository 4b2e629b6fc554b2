"""The on-disk cache: one root, one folder per kind of artifact, one entry per key.

    <root>/curvature/<key>/   fitted curvature (curvature.json + factors*.safetensors)
    <root>/models/<key>/      converted GGUF models (prism_cache.json + model.safetensors)
    <root>/less/<key>/        LESS warm-up adapters
    <root>/generations/<key>/ ProjDiff's sampled own responses (responses.jsonl, appended)

An entry is a folder; it is *complete* once its marker file (written last, atomically)
exists and holds a JSON object, so a killed writer (or a damaged marker) leaves an
incomplete entry that is never read and that ``prune`` removes. Reading an entry
touches its marker: the marker's modification time is the entry's last use, which
orders eviction (least recently used first).

:func:`make_room` evicts entries until a new one of a given size fits under
``max_bytes`` (``--cache-max-gb``) and on the disk. :func:`guarded_write` runs a writer
and turns a failure to write (disk full, read-only, quota) into a warning and a removed
partial entry: the run goes on with what it holds in memory. ``prism-select cache
list | prune | clear`` is built on :func:`entries`, :func:`prune` and :func:`clear`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

#: marker file of a complete entry, by kind (other kinds: any of these)
MARKERS = {"curvature": "curvature.json", "models": "prism_cache.json", "less": "less_warmup.json",
           "generations": "generations.json"}
#: free disk space kept after a write, so the cache never fills the disk to the last byte
DISK_RESERVE_BYTES = 1 << 30
#: an entry evicted within this many seconds of its last use is named in a warning: the
#: bound is too small for the runs that share the cache, which will compute it again
RECENT_USE_S = 3600


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


def dir_size(d: Path) -> int:
    total = 0
    for root, _, files in os.walk(d):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def entries(root) -> list:
    """Every entry under ``root``, least recently used first."""
    root = Path(root)
    out = []
    if not root.is_dir():
        return out
    for kind_dir in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        for d in sorted(p for p in kind_dir.iterdir() if p.is_dir()):
            m = _marker(kind_dir.name, d)
            try:
                used = (m or d).stat().st_mtime
            except OSError:
                continue
            out.append(Entry(kind_dir.name, d, dir_size(d), used,
                             m is not None and not d.name.startswith(".") and _readable(m)))
    return sorted(out, key=lambda e: e.last_used)


def touch(entry_dir) -> None:
    """Mark an entry as used now (its marker's mtime)."""
    d = Path(entry_dir)
    m = _marker(d.parent.name, d)
    if m is not None:
        try:
            os.utime(m)
        except OSError:
            pass


def remove(entry_dir) -> None:
    shutil.rmtree(entry_dir, ignore_errors=True)


def prune(root, max_bytes: int | None = None, keep=(), incomplete_age_s: float = 3600) -> list:
    """Remove incomplete entries older than ``incomplete_age_s``, then the least recently
    used complete ones until the cache holds at most ``max_bytes`` (None: no bound).
    ``keep``: entry folders never removed. Returns the removed entries."""
    keep = {Path(k).resolve() for k in keep}
    now = time.time()
    removed = []
    live = []
    for e in entries(root):
        if e.path.resolve() in keep:
            live.append(e)
        elif not e.complete and now - e.last_used > incomplete_age_s:
            remove(e.path)
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
            remove(e.path)
            removed.append(e)
            total -= e.size
    return removed


def clear(root, kind: str | None = None) -> list:
    """Remove every entry (of ``kind``, if given)."""
    gone = [e for e in entries(root) if kind is None or e.kind == kind]
    for e in gone:
        remove(e.path)
    return gone


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
            if e.complete and e.path.resolve() not in {Path(k).resolve() for k in keep}:
                remove(e.path)
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


def guarded_write(entry_dir, write, what: str) -> bool:
    """Run ``write()`` (which fills ``entry_dir``); on a failure to write (OSError, or a
    writer's own error wrapping one), remove the partial entry, warn, and return False."""
    try:
        write()
        return True
    except Exception as exc:  # safetensors raises its own error type for a full disk
        if not (isinstance(exc, OSError) or "No space left" in str(exc) or "Errno" in str(exc)
                or type(exc).__name__ in ("SafetensorError", "OutputError")):
            raise
        remove(entry_dir)
        log.warning("could not save %s in the cache (%s): the run goes on with it in memory; free disk space "
                    "or set --cache-dir / --cache-max-gb to keep it next time", what, exc)
        return False


def format_size(b: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if b < 1024 or unit == "TiB":
            return f"{b:.1f} {unit}" if unit != "B" else f"{int(b)} B"
        b /= 1024
    return f"{b:.1f} TiB"
