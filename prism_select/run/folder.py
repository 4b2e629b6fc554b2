"""The run folder's life cycle: the lock a run holds on ``--out``, making the folder ready
(a fresh run, or resuming the unfinished one in ``.partial``), reusing a finished run,
the pool's bytes checked unchanged at the end, and what a failed run removes.

``.partial/`` holds ``key.json`` (the run key an unfinished run resumes under), the
finished score chunks and the preconditioned direction ``v`` (whole, or a transient
plan's fit groups, :func:`resume_groups`); a run never writes through a link there."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from pathlib import Path

from safetensors.torch import save_file

from ..runtime import distributed
from .. import locks
from ..data.readers import detect_format
from ..errors import CacheError, InputError, OutputError
from ..io import atomic_write_json, check_writable_dir, read_saved_state, remove_stale_temps, sha256_file

log = logging.getLogger(__name__)

#: the lock file of a run folder (:mod:`prism_select.locks`), held while a run writes it
RUN_LOCK = ".prism-select.lock"


def remove_tree(path: Path) -> None:
    """Remove ``path``: a link (or file) as itself, a folder with what it holds (links in
    it removed as links). Never follows a link."""
    path = Path(path)
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink(missing_ok=True)
    elif path.exists():
        shutil.rmtree(path, ignore_errors=True)


def refuse_links(partial: Path) -> None:
    """:class:`OutputError` if the run folder's ``.partial`` is a symbolic link or holds
    one: a run never writes, reads or resumes through a link planted there."""
    partial = Path(partial)
    found = [partial] if partial.is_symlink() else []
    if not found and partial.is_dir():
        for root, dirs, files in os.walk(partial):  # links are not followed
            found += [Path(root) / n for n in dirs + files if (Path(root) / n).is_symlink()]
            if found:
                break
    if found:
        link = found[0]
        raise OutputError(f"{link} is a symbolic link (to {os.readlink(link)}): a run never writes through a link in "
                          "its run folder; remove the link, or pass --overwrite (which removes it as a link and "
                          "starts the run again)")


@contextlib.contextmanager
def run_folder_lock(out_dir: Path):
    """Hold ``<out>/.prism-select.lock`` for the run (on the main process; every process
    refuses together): a second run with the same ``--out`` is refused by name while
    this one runs. The lock goes with the process however it ends."""
    busy, lock = None, None
    if distributed.is_main():
        lock = locks.held(Path(out_dir) / RUN_LOCK, wait=False)
        try:
            lock.__enter__()
        except locks.Busy as e:
            busy, lock = e, None
        except OSError as e:
            raise OutputError(f"cannot lock the run folder {out_dir}: {e.strerror or e}") from e
    if not distributed.all_or_nothing(busy is None):
        if lock is not None:
            lock.__exit__(None, None, None)
        raise OutputError(f"{out_dir} is in use by another prism-select run ({busy.holder if busy else 'on rank 0'}"
                          " holds its lock): wait for it to finish (run the same command again then to reuse or "
                          "resume it), or choose another --out")
    try:
        yield
    finally:
        if lock is not None:
            lock.__exit__(None, None, None)


def pool_file_sha(pool_path) -> str | None:
    """The pool file's sha256 (a saved dataset's files together), None where it cannot be
    read, or is no regular file or saved dataset (the checks of the inputs name that: a
    device or a pipe is never read)."""
    try:
        detect_format(pool_path)
        return sha256_file(pool_path)
    except InputError:
        return None


def check_pool_unchanged(pool_path, read_sha: str | None, out_dir: Path) -> str:
    """The pool's sha256 now, which must be the one taken when the run read it: a pool
    rewritten while it was scored stops the run (:class:`InputError`), its ``.partial``
    removed (its work scored a file that is no longer there)."""
    now = sha256_file(pool_path)
    if read_sha is not None and now != read_sha:
        if distributed.is_main():
            remove_tree(Path(out_dir) / ".partial")
        raise InputError(f"the pool file changed while the run read and scored it (sha256 {read_sha[:12]}... when "
                         f"read, {now[:12]}... at the end), so its scores would not belong to the file select and "
                         "report read; nothing was written", path=pool_path,
                         fix="run the command again once nothing writes to the pool (copy it first if it is being "
                             "written)")
    return now


def drop_partial_without_chunks(out_dir: Path) -> None:
    """After a failed run: remove ``.partial`` unless it holds finished work (a score chunk,
    a preconditioned direction or a part of one), so that the corrected command (other
    settings) is not refused as an unfinished run."""
    partial = out_dir / ".partial"
    if partial.is_dir() and not partial.is_symlink() and not any(partial.rglob("*.safetensors")):
        shutil.rmtree(partial, ignore_errors=True)


def remove_empty_dirs(created: list) -> None:
    """Remove the folders a failed run created (``--out`` first, then its new parents),
    each only when nothing but an empty ``.partial`` (or its ``key.json``) is in it."""
    partial = created[0] / ".partial"
    if partial.is_dir() and not partial.is_symlink() and {p.name for p in partial.iterdir()} <= {"key.json"}:
        shutil.rmtree(partial, ignore_errors=True)
    for d in created:
        try:
            d.rmdir()
        except OSError:
            return  # not empty (finished work is kept), or already gone


def _differences(a, b, prefix: str = "") -> list:
    """Dotted names of the entries where two JSON-like dicts differ."""
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return [prefix or "(value)"] if a != b else []
    out = []
    for k in sorted(set(a) | set(b)):
        out += _differences(a.get(k), b.get(k), f"{prefix}.{k}" if prefix else k)
    return out


def finished_run(out_dir: Path, run_key: dict) -> dict | None:
    """``run.json`` of a finished run in ``out_dir`` whose recorded ``run_key`` is
    ``run_key``, else None."""
    try:
        done = json.loads((out_dir / "run.json").read_text())
    except (OSError, ValueError):
        return None
    same = (isinstance(done, dict) and done.get("status") == "complete"
            and done.get("run_key") == json.loads(json.dumps(run_key)))
    return done if same and (out_dir / "scores.jsonl").is_file() else None


def prepare_out_dir(out_dir: Path, run_key: dict, overwrite: bool) -> bool:
    """Make ``out_dir`` ready for the run ``run_key``; True where it resumes an unfinished one."""
    check_writable_dir(out_dir)
    run_json = out_dir / "run.json"
    partial = out_dir / ".partial"
    for f in ("scores.jsonl", "pairs.jsonl", "run.json"):
        remove_stale_temps(out_dir / f)  # what a killed earlier run left of its files
    if overwrite:
        remove_tree(partial)  # a planted link is removed as a link, never through
        for f in ("scores.jsonl", "pairs.jsonl", "run.json"):
            (out_dir / f).unlink(missing_ok=True)
        return False
    refuse_links(partial)
    if run_json.exists():
        raise OutputError(f"{out_dir} already holds a finished run (run.json); "
                          "pass --overwrite to replace it, or choose another --out")
    state = partial / "key.json"
    if state.exists():
        old = read_saved_state(state)
        if old != run_key:
            raise CacheError(f"{out_dir} holds an unfinished run with other settings or inputs (differs in: "
                             f"{', '.join(_differences(old, json.loads(json.dumps(run_key)))) or 'types'}); "
                             "rerun its own command to resume it, or pass --overwrite")
        log.info("resuming the unfinished run in %s", out_dir)
        return True
    partial.mkdir(parents=True, exist_ok=True)
    atomic_write_json(state, run_key)
    return False


def save_v(v: dict, partial: Path, name: str, tag: str) -> None:
    """``v`` saved whole in ``partial`` (written beside, then renamed), the files of its
    fit groups removed."""
    tmp = partial / f".{name}.tmp"
    save_file({k: t.detach().contiguous().cpu() for k, t in v.items()}, str(tmp))
    tmp.replace(partial / f"{name}.safetensors")
    for f in partial.glob(f"{tag}_v_group*"):
        f.unlink(missing_ok=True)


def resume_groups(saved: list, planned: list, finished) -> list:
    """The fit groups of a resumed transient run: the saved layout's finished groups
    (``finished(k)``: group ``k``'s part of ``v`` is saved) where they are, and the other
    layers grouped as this process's plan groups them (each a part of a planned group, so
    it fits), in the unfinished positions, then appended; positions left over are empty.
    The saved layout is the earlier process's plan, made for other memory: kept whole, a
    2-group layout of an uncapped H200 run was fitted under a 79.6 GiB cap (5 groups
    planned) and ran out of GPU memory in its first group. Idempotent: the result given
    back as ``saved`` gives itself."""
    done = [k for k, g in enumerate(saved) if g and finished(k)]
    kept = {n for k in done for n in saved[k]}
    fresh = [f for f in ([n for n in g if n not in kept] for g in planned) if f]
    out = [g if k in done else [] for k, g in enumerate(saved)]
    free = [k for k in range(len(saved)) if k not in done]
    for g in fresh:
        if free:
            out[free.pop(0)] = g
        else:
            out.append(g)
    return out

