"""The agreement check run before a ``--scoring fast`` run (pipeline.RunContext.check_fast)
and the rank correlation behind it."""

import json
import logging
import math

import pytest
from conftest import write_inputs
import torch

from prism_select.curvature import CurvatureSettings
from prism_select.evaluation_metrics import spearman
from prism_select.model import LoadedModel, ModelSettings, model_fingerprint
from prism_select.pipeline import FAST_CHECK_MIN_SPEARMAN, ScoreSettings, score_pool

#: agreement of a float64 finite difference at a tiny step with the exact route
CLOSE_SPEARMAN = 0.99


def test_spearman_matches_scipy():
    scipy_stats = pytest.importorskip("scipy.stats")
    g = torch.Generator().manual_seed(0)
    a = torch.randn(50, generator=g, dtype=torch.float64)
    b = a + 0.7 * torch.randn(50, generator=g, dtype=torch.float64)
    assert spearman(a.tolist(), b.tolist()) == pytest.approx(scipy_stats.spearmanr(a, b).statistic, abs=1e-12)
    assert spearman(a.tolist(), (-a).tolist()) == pytest.approx(-1.0)
    assert math.isnan(spearman([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]))


@pytest.mark.parametrize("fd_eps, agrees", [(1e-6, True), (50.0, False)])
def test_fast_run_records_agreement_and_warns(model, tok, tmp_path, pool_examples, pair_examples, caplog,
                                              fd_eps, agrees):
    lm = LoadedModel(model, tok, ModelSettings(model="tiny-test", device="cpu", cache_dir=str(tmp_path / "c")),
                     model_fingerprint(model), {"kind": "test"})
    pool, targets = write_inputs(tmp_path, pool_examples, pair_examples)
    s = ScoreSettings(batch_size=4, progress=False, scoring="fast", fd_eps=fd_eps)
    with caplog.at_level(logging.WARNING):
        summary = score_pool(lm, pool, targets, tmp_path / "run", s, CurvatureSettings(kind="identity"))
    check = summary["fast_check"]["scores"]
    assert check["examples"] == len(pool_examples)
    warned = any("agrees poorly" in r.getMessage() for r in caplog.records)
    if agrees:
        assert check["spearman_vs_exact"] >= CLOSE_SPEARMAN
        assert "warning" not in check and not warned
    else:
        assert not check["spearman_vs_exact"] >= FAST_CHECK_MIN_SPEARMAN
        assert "warning" in check and warned
    assert json.loads((tmp_path / "run" / "run.json").read_text())["fast_check"] == json.loads(json.dumps(
        summary["fast_check"]))


def test_exact_run_has_no_fast_check(model, tok, tmp_path, pool_examples, pair_examples):
    lm = LoadedModel(model, tok, ModelSettings(model="tiny-test", device="cpu", cache_dir=str(tmp_path / "c")),
                     model_fingerprint(model), {"kind": "test"})
    pool, targets = write_inputs(tmp_path, pool_examples, pair_examples)
    summary = score_pool(lm, pool, targets, tmp_path / "run", ScoreSettings(batch_size=4, progress=False),
                         CurvatureSettings(kind="identity"))
    assert "fast_check" not in summary
