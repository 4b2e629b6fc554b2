"""Advisory file locks (``fcntl.flock``) on a run folder and on cache entries being written.

A lock is a file beside (or inside) what it guards, held with ``flock`` for as long as
the work runs. The kernel releases a ``flock`` when its process ends, however it ends
(an exception, Ctrl-C, SIGTERM, SIGKILL, a crash), so a lock file left by a dead process
never blocks a later run: the next one takes the lock on that same file. A released
lock's file is removed; a process that opened the file just before it was removed finds
the name gone (or another file under it) once it holds the lock, and takes the lock on
the file that is there now.

On a system without ``fcntl`` (Windows) :func:`held` holds nothing.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None


class Busy(Exception):
    """Another process holds the lock (raised by :func:`held` with ``wait=False``)."""

    def __init__(self, path: Path, holder: str):
        self.path, self.holder = path, holder
        super().__init__(f"{path} is held by {holder}")


def _holder(fd: int) -> str:
    try:
        text = os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
    except OSError:
        text = ""
    return f"process {text}" if text else "another process"


@contextlib.contextmanager
def held(path: str | os.PathLike, wait: bool = False, timeout_s: float | None = None) -> Iterator[None]:
    """Hold an exclusive lock on the file ``path`` (created if missing, never followed if
    it is a link) for the ``with`` block. ``wait=False``: raise :class:`Busy` at once if
    another process holds it; ``wait=True``: wait for it (at most ``timeout_s`` seconds,
    then :class:`Busy`; None: as long as it takes)."""
    path = Path(path)
    if fcntl is None:  # pragma: no cover
        yield
        return
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o666)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if not wait or (deadline is not None and time.monotonic() > deadline):
                        raise Busy(path, _holder(fd)) from None
                    time.sleep(0.1)
            try:  # the file this lock is on must still be the one under the name
                same = os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False))
            except FileNotFoundError:
                same = False
        except BaseException:
            os.close(fd)
            raise
        if same:
            break
        os.close(fd)  # removed by its last holder meanwhile: lock the file there now
    try:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} on {os.uname().nodename}\n".encode(), 0)
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)


def is_held(path: str | os.PathLike) -> bool:
    """Whether another process holds the lock ``path`` now (a missing file: no)."""
    if fcntl is None:  # pragma: no cover
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
    return False
