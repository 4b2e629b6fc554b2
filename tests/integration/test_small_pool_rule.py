"""The default curvature of a small pool (``--damping-rule auto``): identity in place of
an EK-FAC fit on fewer than SMALL_FIT_EXAMPLES examples, recorded and printed as applied,
one decision shared by every method of a compare, within the memory of a plain run, and
a pool of one record scored."""

import json
from pathlib import Path

import pytest
import torch

from prism_select.cli import main
from prism_select.curvature import CurvatureSettings
from prism_select.errors import ConfigError
from prism_select.examples import make_example
from prism_select.model import ModelSettings
from prism_select.run import score_pool
from prism_select.settings import ScoreSettings

from tiny import save_tiny


@pytest.fixture
def model_dir(tmp_path):
    return save_tiny(tmp_path / "model")


@pytest.fixture
def data(tmp_path):
    return make_example(tmp_path / "data", n_pool=10, n_pairs=3)


def _cli(tmp_path, model_dir, pool, targets, out, *extra):
    return main(["score", "--model", str(model_dir), "--pool", str(pool), "--targets", str(targets),
                 "--out", str(out), "--batch-size", "4", "--max-length", "128", "--device", "cpu",
                 "--dtype", "float32", "--cache-dir", str(tmp_path / "cache"), *extra])


def test_the_rule_takes_identity_below_the_threshold_and_plain_ekfac_from_it():
    from prism_select.run.preflight import SMALL_FIT_EXAMPLES, small_pool_rule
    small, at = SMALL_FIT_EXAMPLES - 1, SMALL_FIT_EXAMPLES
    cs, rec = small_pool_rule(CurvatureSettings(), small)
    assert cs.kind == "identity" and rec == {"requested": "ekfac", "kind": "identity", "n_fit": small,
                                             "rule": "small-pool", "identity_below": SMALL_FIT_EXAMPLES}
    for n in (at, 1000, 5000):  # plain EK-FAC, as kronfluence computes it
        cs, rec = small_pool_rule(CurvatureSettings(), n)
        assert cs == CurvatureSettings() and rec["kind"] == "ekfac" and rec["rule"] == "heuristic"
    # any damping option, another kind or rule: applied as given
    for kw in ({"damping_noise": True}, {"shrinkage": "auto"}, {"damping": 1e-3}, {"damping_factor": 1.0},
               {"damping_rule": "heuristic"}, {"kind": "kfac"}, {"kind": "diagonal"}):
        given = CurvatureSettings(**kw)
        assert small_pool_rule(given, small)[0] == given, kw
    assert small_pool_rule(CurvatureSettings(damping_rule="split-half"), small)[1]["rule"] == "split-half"


def test_a_small_default_run_records_prints_and_reports_the_curvature_it_applied(tmp_path, model_dir, data, capsys):
    out = tmp_path / "run"
    assert _cli(tmp_path, model_dir, *data, out) == 0
    printed = capsys.readouterr()
    run = json.loads((out / "run.json").read_text())
    assert run["curvature_settings"]["kind"] == "ekfac"  # what was asked
    applied = run["curvature_applied"]
    assert applied["kind"] == "identity" and applied["rule"] == "small-pool" and applied["n_fit"] == 10
    assert run["curvature"]["kind"] == "identity"
    assert "curvature: identity (the small-pool rule: the fit sample has 10 examples" in printed.out
    assert "curvature: identity (the small-pool rule" in printed.err  # said when decided
    assert main(["report", "--run", str(out), "--out", str(tmp_path / "r.html")]) == 0
    assert "curvature <code>identity</code>" in (tmp_path / "r.html").read_text()


def test_a_fitted_run_records_its_damping(tmp_path, model_dir, data, capsys):
    out = tmp_path / "run"
    assert _cli(tmp_path, model_dir, *data, out, "--damping-rule", "heuristic") == 0
    applied = json.loads((out / "run.json").read_text())["curvature_applied"]
    assert applied["kind"] == "ekfac" and applied["rule"] == "heuristic" and applied["damping_factor"] == 0.1
    assert 0 < applied["damping"]["min"] <= applied["damping"]["max"]
    assert "curvature: ekfac (heuristic, damping factor 0.1, damping " in capsys.readouterr().out


def test_split_half_that_supports_no_damping_records_identity(tmp_path, model_dir, data, monkeypatch):
    from prism_select.curvature import support
    monkeypatch.setattr(support, "MIN_AGREEMENT", 2.0)  # no correlation reaches it: the halves never agree
    s = ScoreSettings(max_length=128, batch_size=4, progress=False)
    ms = ModelSettings(model=str(model_dir), dtype="float32", device="cpu", cache_dir=str(tmp_path / "c"))
    run = score_pool(ms, *data, tmp_path / "run", s, CurvatureSettings(damping_rule="split-half"))
    assert run["curvature"]["split_half"]["supported"] is False
    assert run["curvature"]["kind"] == "identity" and run["curvature_applied"]["kind"] == "identity"
    assert run["curvature_applied"]["rule"] == "split-half"


def test_compare_applies_one_curvature_to_every_method(tmp_path, model_dir, data, capsys):
    out = tmp_path / "cmp"
    assert main(["compare", "--model", str(model_dir), "--pool", str(data[0]), "--targets", str(data[1]),
                 "--out", str(out), "--methods", "prism", "ifguide", "random", "--batch-size", "4",
                 "--max-length", "128", "--device", "cpu", "--dtype", "float32",
                 "--cache-dir", str(tmp_path / "cache")]) == 0
    res = json.loads((out / "compare.json").read_text())
    assert res["curvature_applied"]["kind"] == "identity" and res["curvature_methods"] == ["prism", "ifguide"]
    runs = {m: json.loads((out / m / "run.json").read_text()) for m in ("prism", "ifguide", "random")}
    assert runs["prism"]["curvature_applied"] == runs["ifguide"]["curvature_applied"] == res["curvature_applied"]
    assert "curvature_applied" not in runs["random"]  # no curvature used
    md = (out / "compare.md").read_text()
    assert "- curvature: identity (the small-pool rule: the fit sample has 10 examples" in md
    assert "shared by prism, ifguide" in md


def test_compare_refuses_split_half_for_several_methods(tmp_path, model_dir, data):
    from prism_select.run.compare import compare
    ms = ModelSettings(model=str(model_dir), dtype="float32", device="cpu", cache_dir=str(tmp_path / "c"))
    with pytest.raises(ConfigError, match="split-half chooses a damping from each method's own direction"):
        compare(ms, *data, tmp_path / "cmp", ["prism", "ifguide"], curvature=CurvatureSettings(
            damping_rule="split-half"))
    assert not (tmp_path / "cmp").exists()


def test_a_small_default_run_holds_no_more_than_a_plain_fitted_run(tmp_path, model_dir, data):
    """The memory plan counts one curvature: a default run on a small pool peaks (live
    tensors, as a GPU's allocator counts them: tests/memtrack.py) at most where a run
    with one plain EK-FAC fit does."""
    from memtrack import LiveBytes
    from prism_select.model import load_model
    ms = ModelSettings(model=str(model_dir), dtype="float32", device="cpu", cache_dir=str(tmp_path / "c"))
    lm = load_model(ms)
    s = ScoreSettings(max_length=128, batch_size=4, progress=False)
    peaks = {}
    for name, cs in (("plain", CurvatureSettings(damping_rule="heuristic")), ("default", CurvatureSettings())):
        with LiveBytes(list(lm.model.parameters())) as probe:
            score_pool(lm, *data, tmp_path / name, s, cs)
        peaks[name] = probe.peak
    assert 0 < peaks["default"] <= peaks["plain"], peaks


def test_a_one_record_pool_is_scored_with_the_default_settings(tmp_path, model_dir, data, capsys):
    pool = tmp_path / "one.jsonl"
    pool.write_text(Path(data[0]).read_text().splitlines()[0] + "\n")
    out = tmp_path / "run"
    assert _cli(tmp_path, model_dir, pool, data[1], out) == 0
    run = json.loads((out / "run.json").read_text())
    assert run["counts"]["pool"] == 1 and run["curvature_applied"]["kind"] == "identity"
    rows = [json.loads(x) for x in (out / "scores.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["rank"] == 1 and torch.isfinite(torch.tensor(rows[0]["score"]))


def test_split_half_on_too_few_records_names_what_to_do(tmp_path, model_dir, data, capsys):
    pool = tmp_path / "three.jsonl"
    pool.write_text("\n".join(Path(data[0]).read_text().splitlines()[:3]) + "\n")
    assert _cli(tmp_path, model_dir, pool, data[1], tmp_path / "run", "--damping-rule", "split-half") != 0
    err = capsys.readouterr().err
    assert "fewer than 4" in err and "leave out --damping-rule" in err and "non-finite" not in err
    assert not (tmp_path / "run").exists()


def test_an_asked_for_split_half_check_shows_its_progress(tmp_path, model_dir, data, capsys):
    assert _cli(tmp_path, model_dir, *data, tmp_path / "run", "--damping-rule", "split-half") == 0
    import re
    err = capsys.readouterr().err
    assert re.search(r"split-half check: +\d+%\|.*\d+/6 \[", err), err  # a bar over its half fits and rungs
