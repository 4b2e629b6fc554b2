"""Saving and reusing fitted curvatures: the key a saved fit must match, and the cache's
load-or-fit (:mod:`prism_select.cache` bounds and lists the entries)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

from .. import cache as cache_entries, settings as _settings
from ..errors import CacheError
from ..io import sha256_json
from ..runtime import distributed
from ..runtime.execution import ExecutionContext
from ..runtime.precision import fit_arithmetic
from ..settings import key_of
from .base import Curvature, FitSettings, apply_damping
from .fit import FitLayout, FitSpill, fit_curvature

log = logging.getLogger(__name__)


def curvature_key(settings: FitSettings, model_fingerprint: str, pool_fingerprint: str,
                  layers: list, max_length: int, arithmetic: str) -> dict:
    """What a saved curvature must match to be reused: exactly what determines the fitted
    factors: the key fields of :class:`FitSettings` (not its batch size, which does not
    change the sums). The damping and the shrinkage (:class:`PreconditionSettings`) are
    applied when preconditioning (:func:`apply_damping`), so a new ``--damping`` or
    ``--shrinkage`` reuses the fit. ``arithmetic``
    is how the fit computed (:func:`prism_select.runtime.precision.fit_arithmetic`: the weights'
    dtype, and whether ``--precision split32`` was active)."""
    return {
        "settings": key_of(settings, FitSettings),
        "model_fingerprint": model_fingerprint,
        "pool_fingerprint": pool_fingerprint,
        "layers_key": sha256_json(layers),
        "max_length": max_length,
        "arithmetic": arithmetic,
    }


@dataclass(frozen=True)
class FitCache:
    """Where fitted curvatures are kept, and what identifies this fit's inputs.

    root: the cache directory of curvatures. model_fingerprint, pool_fingerprint,
    max_length: the model, the fit examples and their truncation (:func:`curvature_key`).
    max_bytes: the cache's bound (older entries are evicted to make room; None: the free
    disk space only)."""

    root: Path | str
    model_fingerprint: str
    pool_fingerprint: str
    max_length: int
    max_bytes: int | None = None


def load_or_fit_curvature(model, modules, encoded, settings, *, pad_id, cache: FitCache,
                          execution: ExecutionContext | None = None, timings: dict | None = None,
                          layout: FitLayout = FitLayout(), on_group=None, spill: FitSpill = FitSpill()):
    """Reuse a saved curvature whose settings, fingerprints and arithmetic match, else fit
    and save it (``execution``, ``timings``, ``layout``, ``on_group`` and ``spill`` as in
    :func:`fit_curvature`; a reused curvature is handed to ``on_group`` whole, and does not
    score; the spill goes where the cache is, a disk rather than a RAM-backed /tmp).

    The cache (:mod:`prism_select.cache`) is bounded by ``cache.max_bytes``: older entries
    are evicted to make room, and a curvature larger than the bound, a ``transient`` one,
    or one whose write fails (disk full) is not kept: the run goes on with it in memory.
    Returns ``(curvature, directory, reused)``.
    """
    execution = execution or ExecutionContext.of(model)
    key = curvature_key(settings, cache.model_fingerprint, cache.pool_fingerprint, list(modules), cache.max_length,
                        fit_arithmetic(model, execution))
    directory = Path(cache.root) / sha256_json(key)[:24]
    cur = _load_saved(settings, key, directory, layout.store, execution.device)
    if distributed.all_or_nothing(cur is not None):
        log.info("reusing curvature from %s", directory)
        cache_entries.touch(directory)
        if on_group is not None:
            on_group(list(cur.layers), cur)
        return cur, directory, True
    spill_dir = None
    try:
        Path(cache.root).mkdir(parents=True, exist_ok=True)
        spill_dir = str(cache.root)
    except OSError:
        pass
    cur = fit_curvature(model, modules, encoded, settings, pad_id=pad_id, execution=execution, timings=timings,
                        layout=layout, on_group=on_group, spill=replace(spill, dir=spill_dir))
    if settings.kind == "identity":
        return cur, directory, False
    if layout.store == "transient":
        log.info("the curvature was not kept (transient memory plan), so it is not cached")
        return cur, None, False
    if cur.meta.get("owners"):
        log.info("the curvature's factors are sharded over the ranks (FSDP), so it is not cached")
        return cur, None, False
    return cur, _save(cur, key, directory, cache), False


def _load_saved(settings, key: dict, directory: Path, store: str, device):
    """The saved curvature of ``key`` with its damping, if every rank can load it, else None.
    Under torchrun the fit is collective: reuse only if every rank loads the saved copy (a
    cache directory that is not shared by all nodes means fitting again). A transient plan
    means the whole curvature does not fit host memory: it is never loaded."""
    cur = None
    if settings.kind != "identity" and store != "transient" \
            and distributed.all_or_nothing((directory / "curvature.json").exists()):
        try:
            cur = apply_damping(Curvature.load(directory, expect=key, device="cpu" if store != "device" else device),
                                settings)
        except CacheError as exc:
            log.warning("%s; fitting again", exc)
    return cur


def _save(cur: Curvature, key: dict, directory: Path, cache: FitCache):
    """Save a fitted curvature in the cache, room made for it; returns its directory, or
    None where it is not kept (no room, or a failed write)."""
    size = sum(t.numel() * t.element_size() for t in cur.tensors.values())
    root = Path(cache.root).parent
    room = True
    if distributed.is_main():
        room = cache_entries.make_room(root, size, cache.max_bytes, keep=[directory])
        if not room:
            log.warning("the fitted curvature (%s) does not fit the cache (--cache-max-gb, or the free disk "
                        "space under %s): it is used from memory and not saved", _settings.format_size(size),
                        root)
    if distributed.all_or_nothing(room):
        saved = cache_entries.guarded_write(directory, lambda: cur.save(directory, key), "the fitted curvature",
                                            lock=distributed.is_main())
        return directory if saved else None
    return None
