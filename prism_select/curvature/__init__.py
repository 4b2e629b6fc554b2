"""Curvature ``H`` and its damped inverse, behind one interface.

``identity``  ``H = I``: plain gradient dot products.
``diagonal``  ``H = diag(mean_n G_n**2) + lambda``.
``kfac``      ``H_l = A_l (x) S_l + lambda`` per tracked layer (Kronecker factors).
``ekfac``     K-FAC eigenbasis with corrected eigenvalues (George et al. 2018):
              ``H_l = (Q_A (x) Q_S) diag(Lambda_l) (Q_A (x) Q_S)^T + lambda``.

Every variant approximates the empirical Fisher (or, with sampled labels, the
true Fisher) of the *summed* per-example SFT loss, averaged over fit examples:
``F = (1/N) sum_n vec(G_n) vec(G_n)^T``. See :mod:`prism_select.curvature.fit`.
"""

from .base import KINDS, Curvature, CurvatureSettings, FitSettings, PreconditionSettings
from .fit import FitLayout, FitSpill, fit_curvature
from .store import FitCache, load_or_fit_curvature

__all__ = ["Curvature", "CurvatureSettings", "FitSettings", "PreconditionSettings", "KINDS", "FitCache", "FitLayout",
           "FitSpill", "fit_curvature", "load_or_fit_curvature"]
