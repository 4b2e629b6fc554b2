"""Whether a fit sample supports its curvature: split-half agreement.

EK-FAC estimates, per layer, eigenbases and corrected eigenvalues from ``N`` fit
examples. With few examples the damped inverse ``(H + lambda I)^-1`` amplifies what the
particular sample happened to contain, and the direction ``v = H^-1 g_KL`` becomes a
property of the sample rather than of the model. This module measures that from the fit
sample itself: it is split at random into two halves, EK-FAC is fitted on each, and each
half's ``v`` scores the whole fit sample at every damping factor of
:data:`DAMPING_LADDER`. The halves *agree* at a factor when the Spearman correlation of
their two score lists (:func:`prism_select.metrics.spearman`) reaches
:data:`MIN_AGREEMENT`: the sample then determines the ranking, not the half it came from.
A constant score list has no ranking (its Spearman is NaN); it is no disagreement, so it
does not stop the walk.

:func:`supported_damping_factor` reads the answer: the least factor of the ladder from
which on the halves agree at every larger factor too (the least damping the sample
supports), or ``None`` when they disagree at the largest (the sample cannot support a
curvature; identity ranks by ``g_KL`` itself). So the ladder is walked from the largest
factor down and the walk stops at the first disagreement (:func:`walk_ladder`). The
check costs two half-size fits and two scorings of the fit sample per factor walked, so
it is meant for small fit samples.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


#: damping factors tried, each x the layer's mean eigenvalue (0.1: the default heuristic)
DAMPING_LADDER = (0.1, 1.0, 10.0, 100.0)
#: the halves agree when their score lists correlate (Spearman) at least this much
MIN_AGREEMENT = 0.9
#: the fewest fit examples the check takes: two halves of two (a rank correlation needs two
#: scores, a half fit one example at least)
MIN_FIT_EXAMPLES = 4


@dataclass
class SplitHalf:
    """The agreement of the two half-sample fits at each damping factor, and the choice."""

    n_fit: int
    agreement: dict  # damping factor -> Spearman correlation of the halves' scores
    factor: float | None  # the smallest factor that agrees; None: no curvature is supported

    def to_json(self) -> dict:
        return {"n_fit": self.n_fit, "min_agreement": MIN_AGREEMENT,
                "agreement": {f"{f:g}": round(a, 4) for f, a in self.agreement.items()},
                "damping_factor": self.factor, "supported": self.factor is not None}


#: the fit-sample examples the halves' scores are compared on, at most: a seeded subset of a
#: larger fit sample. Each rung of the ladder scores them twice, so the check's scoring
#: stays bounded (on an 880-record pool scoring all of them took 140-200 s of a method's
#: 160-270 s, 135M model, four runs sharing an H200, 2026-11-28); a Spearman correlation
#: near MIN_AGREEMENT over 256 examples has a standard error of about 0.01.
AGREEMENT_EXAMPLES = 256


#: the check scores rungs' two directions together (one forward and backward a batch for
#: all of them) while they hold at most this many numbers in all; beyond it (large
#: tracked layers) fewer rungs a pass, down to each direction on its own
STACKED_LADDER_MAX_ELEMENTS = 1 << 30


#: the stacked directions are held three times while the scorer is built: the list of
#: ``v``, their per-layer stack and each layer's ``out x (K in)`` layout
#: (:func:`prism_select.scoring.score_directions`, :class:`prism_select.engine.linear`)
STACKED_LADDER_COPIES = 3


def stacked_ladder_bytes(direction: dict) -> int:
    """Device bytes the stacked ladder holds while scored: every rung's two directions
    shaped like ``direction``, :data:`STACKED_LADDER_COPIES` times."""
    each = sum(int(d.numel()) * d.element_size() for d in direction.values())
    return STACKED_LADDER_COPIES * 2 * len(DAMPING_LADDER) * each


def agreement_sample(n: int, seed: int) -> list:
    """The fit-sample positions the halves are compared on: all ``n`` up to
    AGREEMENT_EXAMPLES, else that many drawn with ``seed`` (sorted)."""
    if n <= AGREEMENT_EXAMPLES:
        return list(range(n))
    return sorted(random.Random(f"split-half-agreement:{seed}").sample(range(n), AGREEMENT_EXAMPLES))


def split_halves(n: int, seed: int) -> tuple[list, list]:
    """Two disjoint random halves of ``range(n)`` (the second one larger when ``n`` is odd)."""
    order = list(range(n))
    random.Random(f"split-half:{seed}").shuffle(order)
    return sorted(order[: n // 2]), sorted(order[n // 2:])


def supported_damping_factor(agreement: dict) -> float | None:
    """The least damping factor from which on every factor agrees (:data:`MIN_AGREEMENT`);
    None when the largest does not."""
    chosen = None
    for factor in sorted(agreement, reverse=True):
        if agreement[factor] < MIN_AGREEMENT:
            break
        chosen = factor
    return chosen


def walk_ladder(agreement_at) -> dict:
    """``agreement_at(factor)`` for the ladder's factors from the largest down, until the
    first that disagrees: the agreements :func:`supported_damping_factor` needs."""
    out = {}
    for factor in sorted(DAMPING_LADDER, reverse=True):
        out[factor] = agreement_at(factor)
        if out[factor] < MIN_AGREEMENT:
            break
    return out


def split_half(n_fit: int, agreement: dict) -> SplitHalf:
    """The check's result from the agreements of :func:`walk_ladder`."""
    return SplitHalf(n_fit, dict(sorted(agreement.items())), supported_damping_factor(agreement))
