"""Baseline scoring methods, through the same interface as PRISM.

Every method is a function ``(ctx: RunContext) -> (scores, pair_rows)``: ``scores`` a
float64 tensor in pool order, higher = more aligned with the target behaviour (the
target-positive is each pair's ``chosen``); ``pair_rows`` the lines of pairs.jsonl
(may be empty). A method reads its options from ``ctx.settings.method_options``
(documented in its docstring; an unknown option is an error) and records what it
used in ``ctx.info["method"]`` (part of run.json). Gradient methods share the run's
one curvature through ``ctx.curvature()`` / ``ctx.score_direction()``.

``REGISTRY`` maps method name -> function. Methods of this package:

random      uniform scores from the run seed                 (random_scores.py)
ifguide     IF-Guide token-level influence, document sum     (ifguide.py)
ifguide_harmonic  IF-Guide, its harmonic top-token rule     (ifguide.py)
vecfilter   VecFilter, activation projection                 (concept.py)
projdiff    ProjDiff, projection difference to own response  (concept.py)
conceptinf  Concept Influence                                (concept.py)
saefeat     SAE latent activation                            (saefeat.py)

Plug-ins: each module named in ``PLUGINS`` (``less.py``, ``judge.py``) is imported when
its file exists, and must define ``METHODS: dict[name -> function]`` (optionally
``DESCRIPTIONS: dict[name -> one line]``; else a function's ``description`` attribute
or the first line of its docstring is used). Its import errors are not hidden.
"""

from __future__ import annotations

import importlib
import importlib.util

from ..settings import BASELINE_METHODS
from .concept import conceptinf_method, projdiff_method, vecfilter_method
from .ifguide import ifguide_harmonic_method, ifguide_method
from .random_scores import random_method
from .saefeat import saefeat_method

PLUGINS = ("less", "judge")

CORE_DESCRIPTIONS = {
    "prism": "PRISM: g_z . H^-1 g_KL, target pairs weighted by the model's preference pi_q = sigmoid(margin)",
    "equal": "PRISM ablation: equal aggregation g_0 (every pi_q = 1)",
    "unpaired": "PRISM ablation: positive responses only, weighted by their length-normalised likelihood",
    "prism_shuffled": "control of PRISM's weights: PRISM with pi permuted across the pairs (seeded; "
                      "option shuffle_seed)",
    "equal_top_half": "control of PRISM's weights: equal aggregation over the pairs whose pi is above the median",
}

REGISTRY: dict = {}
DESCRIPTIONS: dict = {}


def _describe(fn, extra: dict, name: str) -> str:
    if name in extra:
        return extra[name]
    if getattr(fn, "description", None):
        return fn.description
    doc = (fn.__doc__ or "").strip()
    return doc.splitlines()[0] if doc else ""


def _register(name: str, fn, description: str, origin: str):
    if not callable(fn):
        raise TypeError(f"baseline {name!r} from {origin} is not callable")
    if name in REGISTRY or name in CORE_DESCRIPTIONS:
        raise TypeError(f"baseline name {name!r} from {origin} is already taken")
    if name not in BASELINE_METHODS:
        raise TypeError(f"baseline name {name!r} from {origin} is not in settings.BASELINE_METHODS, which the "
                        "settings check method names against: add it there")
    REGISTRY[name] = fn
    DESCRIPTIONS[name] = description


for _fn in (random_method, ifguide_method, ifguide_harmonic_method, vecfilter_method, projdiff_method,
            conceptinf_method, saefeat_method):
    _register(_fn.method_name, _fn, _fn.description, __name__)


def _load_plugins():
    for mod_name in PLUGINS:
        full = f"{__name__}.{mod_name}"
        if importlib.util.find_spec(full) is None:
            continue
        before = set(REGISTRY)
        mod = importlib.import_module(full)  # errors inside the plug-in surface here
        extra = getattr(mod, "DESCRIPTIONS", None) or {}
        methods = getattr(mod, "METHODS", None)
        if methods is None:
            # A plug-in may also add itself to REGISTRY (``from . import REGISTRY``).
            methods = {n: REGISTRY[n] for n in set(REGISTRY) - before}
            for n in methods:
                del REGISTRY[n]
        if not isinstance(methods, dict) or not methods:
            raise TypeError(f"{full} must define METHODS: a non-empty dict of method name -> function "
                            "(ctx) -> (scores, pair_rows)")
        for name, fn in methods.items():
            if REGISTRY.get(name) is fn:
                DESCRIPTIONS.setdefault(name, _describe(fn, extra, name))
                continue
            _register(name, fn, _describe(fn, extra, name), full)


_load_plugins()


def describe_methods() -> dict:
    """Every scoring method (PRISM and its ablations first) -> one-line description."""
    return {**CORE_DESCRIPTIONS, **DESCRIPTIONS}


__all__ = ["REGISTRY", "DESCRIPTIONS", "describe_methods", "PLUGINS"]
