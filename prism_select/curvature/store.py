"""Saving and reusing fitted curvatures: the key a saved fit must match, and the cache's
load-or-fit (:mod:`prism_select.cache` bounds and lists the entries)."""

from __future__ import annotations

import logging

from .. import distributed
from ..errors import CacheError
from ..execution import DEFAULT_KERNELS, Kernels
from ..precision import fit_arithmetic
from ..io import sha256_json
from ..settings import key_of
from .base import Curvature, FitSettings, apply_damping
from .fit import FitScores, fit_curvature

log = logging.getLogger(__name__)


def curvature_key(settings: FitSettings, model_fingerprint: str, pool_fingerprint: str,
                  layers: list, max_length: int, arithmetic: str) -> dict:
    """What a saved curvature must match to be reused: exactly what determines the fitted
    factors: the key fields of :class:`FitSettings` (not its batch size, which does not
    change the sums). The damping and the shrinkage (:class:`PreconditionSettings`) are
    applied when preconditioning (:func:`apply_damping`), so a new ``--damping`` or
    ``--shrinkage`` reuses the fit. ``arithmetic``
    is how the fit computed (:func:`prism_select.precision.fit_arithmetic`: the weights'
    dtype, and whether ``--precision split32`` was active)."""
    return {
        "settings": key_of(settings, FitSettings),
        "model_fingerprint": model_fingerprint,
        "pool_fingerprint": pool_fingerprint,
        "layers_key": sha256_json(layers),
        "max_length": max_length,
        "arithmetic": arithmetic,
    }


def load_or_fit_curvature(model, modules, encoded, settings, *, pad_id, cache_root,
                          model_fingerprint, pool_fingerprint, max_length, device=None, progress=True,
                          cuda_graphs: str = "auto", timings: dict | None = None, precision: str = "model",
                          groups: list | None = None, store: str = "device", on_group=None,
                          cache_max_bytes: int | None = None, kernels: Kernels = DEFAULT_KERNELS,
                          offload: bool | None = None, on_spill=None, scores: FitScores | None = None,
                          sharded_sums: str = "step"):
    """Reuse a saved curvature whose settings, fingerprints and arithmetic match, else fit
    and save it (``timings``, ``precision``, ``groups``, ``store``, ``offload``, ``on_group``,
    ``on_spill``, ``scores`` and ``sharded_sums`` as in :func:`fit_curvature`; a reused curvature is handed to
    ``on_group`` whole, and does not score).

    The cache (:mod:`prism_select.cache`) is bounded by ``cache_max_bytes``: older entries
    are evicted to make room, and a curvature larger than the bound, a ``transient`` one,
    or one whose write fails (disk full) is not kept: the run goes on with it in memory.
    Returns ``(curvature, directory, reused)``.
    """
    from pathlib import Path

    from .. import cache

    key = curvature_key(settings, model_fingerprint, pool_fingerprint, list(modules), max_length,
                        fit_arithmetic(model, precision))
    directory = Path(cache_root) / sha256_json(key)[:24]
    # Under torchrun the fit is collective: reuse only if every rank loads the saved copy
    # (a cache directory that is not shared by all nodes means fitting again).
    cur = None
    # a transient plan means the whole curvature does not fit host memory: never load it
    if settings.kind != "identity" and store != "transient" \
            and distributed.all_or_nothing((directory / "curvature.json").exists()):
        try:
            cur = apply_damping(Curvature.load(directory, expect=key, device="cpu" if store != "device" else device),
                                settings)
        except CacheError as exc:
            log.warning("%s; fitting again", exc)
    if distributed.all_or_nothing(cur is not None):
        log.info("reusing curvature from %s", directory)
        cache.touch(directory)
        if on_group is not None:
            on_group(list(cur.layers), cur)
        return cur, directory, True
    spill_dir = None  # the spill goes where the cache is (a disk, not a RAM-backed /tmp)
    try:
        Path(cache_root).mkdir(parents=True, exist_ok=True)
        spill_dir = str(cache_root)
    except OSError:
        pass
    cur = fit_curvature(model, modules, encoded, settings, pad_id=pad_id, device=device, progress=progress,
                        cuda_graphs=cuda_graphs, timings=timings, precision=precision, groups=groups,
                        store=store, on_group=on_group, spill_dir=spill_dir, kernels=kernels, offload=offload,
                        on_spill=on_spill, scores=scores, sharded_sums=sharded_sums)
    if settings.kind == "identity":
        return cur, directory, False
    if store == "transient":
        log.info("the curvature was not kept (transient memory plan), so it is not cached")
        return cur, None, False
    if cur.meta.get("owners"):
        log.info("the curvature's factors are sharded over the ranks (FSDP), so it is not cached")
        return cur, None, False
    size = sum(t.numel() * t.element_size() for t in cur.tensors.values())
    root = Path(cache_root).parent
    room = True
    if distributed.is_main():
        room = cache.make_room(root, size, cache_max_bytes, keep=[directory])
        if not room:
            log.warning("the fitted curvature (%s) does not fit the cache (--cache-max-gb, or the free disk "
                        "space under %s): it is used from memory and not saved", cache.format_size(size), root)
    if distributed.all_or_nothing(room):
        saved = cache.guarded_write(directory, lambda: cur.save(directory, key), "the fitted curvature")
        return cur, directory if saved else None, False
    return cur, None, False
