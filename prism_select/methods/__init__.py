"""The scoring methods, PRISM's and the baselines', through one registry.

Every method is a function ``(ctx: RunContext) -> (scores, pair_rows)``: ``scores`` a
float64 tensor in pool order, higher = more aligned with the target behaviour (the
target-positive is each pair's ``chosen``); ``pair_rows`` the lines of pairs.jsonl
(may be empty). A method is declared in its own file with
:func:`~prism_select.methods.registry.register` (its name, its options as a frozen
dataclass, a one-line description and its facts), reads its options through
:func:`~prism_select.methods.common.resolve_options` (an unknown option or a wrong type
is an error) and records what it used in ``ctx.info["method"]`` (part of run.json).
Gradient methods share the run's one curvature through ``ctx.curvature()`` /
``ctx.score_direction()``.

prism, equal, unpaired, prism_shuffled, equal_top_half   PRISM, its ablations and the
                                          controls of its weights        (prism.py)
random      uniform scores from the run seed                 (random_scores.py)
ifguide     IF-Guide token-level influence, document sum     (ifguide.py)
ifguide_harmonic  IF-Guide, its harmonic top-token rule     (ifguide.py)
vecfilter   VecFilter, activation projection                 (concept.py)
projdiff    ProjDiff, projection difference to own response  (concept.py)
conceptinf  Concept Influence                                (concept.py)
saefeat     SAE latent activation                            (saefeat.py)
less        LESS, LoRA gradient similarity                   (less/)
judge       LLM judge                                        (judge.py)

:func:`get` (a name's :class:`~prism_select.methods.registry.Method`), :func:`names` and
:func:`describe_methods` read the registry, which imports every module of this package
the first time it is read (:func:`~prism_select.methods.registry.load`): a new method is
one new file here. ``common.py`` and ``generation.py`` hold what the methods share;
several methods side by side on one loaded model: :mod:`prism_select.run.compare`.
"""

from __future__ import annotations

from .registry import Method, NoOptions, describe_methods, get, names, parse_options, register

__all__ = ["Method", "NoOptions", "describe_methods", "get", "names", "parse_options", "register"]
