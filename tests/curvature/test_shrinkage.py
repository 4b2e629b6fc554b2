"""EK-FAC eigenvalue shrinkage toward K-FAC (``CurvatureSettings.shrinkage``) and the
noise damping (``damping_noise``) against float64 references built from explicit
per-example gradients on a tiny Llama."""

import pytest
import torch

from prism_select.curvature import Curvature, CurvatureSettings, fit_curvature
from prism_select.curvature.base import apply_damping
from prism_select.curvature.store import curvature_key
from prism_select.errors import CacheError, ConfigError

from reference import explicit_fisher_pieces, rel_err

# float64 end to end: summation order and the eigensolver only (as test_numerics' 1e-7)
SHRINK_REL_TOL = 1e-7
LAYER = "model.layers.1.mlp.down_proj"


def _fit(model, modules, encoded, **kw):
    return fit_curvature(model, modules, encoded, CurvatureSettings(kind="ekfac", batch_size=3, **kw),
                         pad_id=0)


def _explicit(cur, model, modules, tok, encoded):
    """Layer LAYER from explicit per-example gradients: A, S, the eigenbases the fit chose,
    Lambda and the variance of its estimate (summed over its entries)."""
    A, S, G = explicit_fisher_pieces(model, modules, LAYER, encoded, tok)
    QA, QS = cur.tensors[f"{LAYER}::QA"], cur.tensors[f"{LAYER}::QS"]
    R2 = (QS.T @ G @ QA) ** 2  # (n, out, in)
    var = float(R2.var(0, unbiased=True).sum()) / G.shape[0]  # variance of a mean of n examples
    return A, S, QA, QS, R2.mean(0), var


def _check_precondition(cur, modules, QA, QS, eig, lam_d):
    """precondition() of LAYER equals an explicit damped inverse of Q diag(eig) Q^T."""
    Q = torch.kron(QA, QS)
    M = Q @ torch.diag(eig.T.reshape(-1)) @ Q.T
    g = torch.randn(*eig.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    ref = torch.linalg.solve(M + lam_d * torch.eye(M.shape[0], dtype=M.dtype), g.T.reshape(-1))
    got = cur.precondition({k: (g if k == LAYER else torch.zeros_like(m.weight)) for k, m in modules.items()})[LAYER]
    assert rel_err(got.T.reshape(-1), ref) <= SHRINK_REL_TOL


def test_auto_shrinkage_matches_explicit_ledoit_wolf(model, modules, tok, encoded_pool):
    """Lambda, its sampling variance, the K-FAC target, the Ledoit-Wolf weight and the
    damped inverse of the shrunk matrix, each from explicit per-example gradients."""
    lam_d = 1e-3
    cur = _fit(model, modules, encoded_pool, damping=lam_d, shrinkage="auto")
    A, S, QA, QS, Lam, var = _explicit(cur, model, modules, tok, encoded_pool)
    assert float(cur.tensors[f"{LAYER}::LambdaVar"]) == pytest.approx(var, rel=SHRINK_REL_TOL)
    kfac = torch.outer(torch.diag(QS.T @ S @ QS), torch.diag(QA.T @ A @ QA))
    target = kfac * Lam.sum() / kfac.sum()
    rho = min(1.0, var / float(((Lam - target) ** 2).sum()))
    assert 0 < rho < 1  # the test exercises a real mixture
    assert cur.shrinkage[LAYER] == pytest.approx(rho, rel=SHRINK_REL_TOL)
    _check_precondition(cur, modules, QA, QS, (1 - rho) * Lam + rho * target, lam_d)


def test_noise_damping_adds_the_rms_standard_error(model, modules, tok, encoded_pool):
    """damping_noise: the heuristic damping plus sqrt(sum of the variances / entries), the
    variances from explicit per-example gradients; preconditioning uses it."""
    cur = _fit(model, modules, encoded_pool, damping_noise=True)
    _, _, QA, QS, Lam, var = _explicit(cur, model, modules, tok, encoded_pool)
    se = (var / Lam.numel()) ** 0.5
    lam_d = 0.1 * float(Lam.mean()) + se
    assert se > 0.1 * float(Lam.mean())  # eight examples: the noise term dominates
    assert cur.damping[LAYER] == pytest.approx(lam_d, rel=SHRINK_REL_TOL)
    _check_precondition(cur, modules, QA, QS, Lam, lam_d)
    # an explicit damping is taken as given
    fixed = apply_damping(cur, CurvatureSettings(damping=1e-3, damping_noise=True))
    assert set(fixed.damping.values()) == {1e-3}


def test_weight_vanishes_with_more_examples(model, modules, encoded_pool):
    """The pool repeated 4 times has the same Lambda and fourth moments but 4n examples:
    the variance, and so the weight, falls by exactly (n - 1) / (4n - 1), toward EK-FAC."""
    n = len(encoded_pool)
    one = _fit(model, modules, encoded_pool, shrinkage="auto")
    four = _fit(model, modules, encoded_pool * 4, shrinkage="auto")
    ratio = (n - 1) / (4 * n - 1)
    for k in modules:
        assert torch.allclose(four.tensors[f"{k}::Lambda"], one.tensors[f"{k}::Lambda"], rtol=1e-10, atol=1e-14)
        if one.shrinkage[k] < 1:
            assert four.shrinkage[k] == pytest.approx(one.shrinkage[k] * ratio, rel=SHRINK_REL_TOL)
    assert max(four.shrinkage.values()) < 0.5 * max(one.shrinkage.values())


def test_off_is_ekfac_and_full_weight_ranks_as_kfac(model, modules, encoded_pool):
    """shrinkage off: the fitted Lambda itself; weight 1 with the heuristic damping: the
    K-FAC preconditioner divided by the trace-matching scale (same ranking)."""
    ek = _fit(model, modules, encoded_pool, shrinkage="off")
    assert all(ek.shrinkage[k] == 0 for k in modules)
    for k in modules:
        assert torch.equal(ek.eigenvalues(k), ek.tensors[f"{k}::Lambda"])
    full = apply_damping(Curvature("ekfac", ek.layers, ek.tensors, {}), CurvatureSettings(shrinkage=1.0))
    kf_t = {k: t for k, t in ek.tensors.items() if k.endswith(("::QA", "::QS", "::lamA", "::lamS"))}
    kf = apply_damping(Curvature("kfac", ek.layers, kf_t, {}), CurvatureSettings(kind="kfac"))
    g = {k: torch.randn_like(m.weight) for k, m in modules.items()}
    a, b = full.precondition(g), kf.precondition(g)
    for k in modules:
        scale = float(ek.tensors[f"{k}::Lambda"].sum() / kf.eigenvalues(k).sum())
        assert rel_err(a[k] * scale, b[k]) <= SHRINK_REL_TOL
        # the heuristic damping is unchanged by the shrinkage (same mean eigenvalue)
        assert full.damping[k] == pytest.approx(ek.damping[k], rel=SHRINK_REL_TOL)


def test_shrinkage_is_not_in_the_cache_key_and_old_fits_are_refused():
    def key(**kw):
        return curvature_key(CurvatureSettings(**kw), "m", "p", ["l"], 64, "float32")

    assert key(shrinkage="off") == key(shrinkage="auto") == key(shrinkage=0.3) == key(damping_noise=True)
    old = Curvature("ekfac", ["l"], {"l::QA": torch.eye(2), "l::QS": torch.eye(2),
                                     "l::Lambda": torch.ones(2, 2)}, {})
    assert apply_damping(old, CurvatureSettings(shrinkage="off")).shrinkage == {"l": 0.0}
    for kw in ({"shrinkage": "auto"}, {"damping_noise": True}):
        with pytest.raises(CacheError, match="predates"):
            apply_damping(old, CurvatureSettings(**kw))


@pytest.mark.parametrize("bad", ["on", 1.5, -0.1, True, None])
def test_shrinkage_setting_is_checked(bad):
    with pytest.raises(ConfigError, match="shrinkage"):
        CurvatureSettings(shrinkage=bad)
    with pytest.raises(ConfigError, match="damping_noise"):
        CurvatureSettings(damping_noise=bad if bad is not True else 1)
