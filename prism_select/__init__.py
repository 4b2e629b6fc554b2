"""prism-select: PRISM, preference-aware influence-function data selection.

Pipeline: data -> model -> preference -> gradients -> curvature -> scores -> selection.

The public face, three calls (each imported on first use, so that ``import prism_select``
and the CLI's ``--help`` stay fast)::

    import prism_select as ps
    ps.score("default", "pool.jsonl", "targets.jsonl", "runs/prism")
    ps.select("runs/prism", "pool.jsonl", "selected.jsonl", keep="5%")

``score`` (:func:`prism_select.api.score`: :func:`prism_select.run.score_pool`, taking a model name or path as well as
``ModelSettings`` or a loaded model), ``compare`` (several methods on one loaded model),
``select``, ``load_model``, the settings of each stage: ``ModelSettings``,
``ScoreSettings``, ``CurvatureSettings``, and ``Run`` (a run folder's ``run.json``, typed:
``ps.Run.from_json("runs/prism/run.json")``).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

#: public name -> (module, attribute)
_PUBLIC = {
    "score": ("prism_select.api", "score"),
    "load_model": ("prism_select.model", "load_model"),
    "ModelSettings": ("prism_select.model", "ModelSettings"),
    "ScoreSettings": ("prism_select.settings", "ScoreSettings"),
    "CurvatureSettings": ("prism_select.curvature", "CurvatureSettings"),
    "select": ("prism_select.selection", "select"),
    "compare": ("prism_select.run.compare", "compare"),
    "Run": ("prism_select.run", "Run"),
}

__all__ = [*_PUBLIC, "__version__"]


def __getattr__(name: str):
    if name in _PUBLIC:
        module, attr = _PUBLIC[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'prism_select' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_PUBLIC))
