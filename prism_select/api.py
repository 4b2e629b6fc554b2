"""The calls of the public face that are more than a name for a library function
(``prism_select.score``); the rest of the face is :data:`prism_select._PUBLIC`."""

from __future__ import annotations

from .model import ModelSettings
from .run import score_pool


def score(model, pool, targets, out, settings=None, curvature=None, **kw) -> dict:
    """Score every record of ``pool`` against the target pairs of ``targets`` into the run
    folder ``out``; returns the run's summary (its ``run.json``). ``model``: ``"default"``,
    a Hugging Face directory, a ``.gguf`` file, a ``ModelSettings`` or a loaded model;
    ``settings`` / ``curvature``: ``ScoreSettings`` / ``CurvatureSettings`` (defaults: PRISM
    with EK-FAC). Other keywords go to :func:`prism_select.run.score_pool`."""

    if isinstance(model, str) or hasattr(model, "__fspath__"):
        model = ModelSettings(model=str(model))
    return score_pool(model, pool, targets, out, settings, curvature, **kw)
