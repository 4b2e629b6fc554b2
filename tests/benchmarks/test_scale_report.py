"""benchmarks/scale_report.py on a hand-written run.json: the row it reads and the projection
of its stage times to another pool size, GPU count and fit sample (no model, no GPU)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "scale_report.py"
REL_TOL = 1e-12
GiB = 1 << 30

# the measured run: 2 GPUs, a pool of 5000, a fit sample of 1000
WORLD, POOL, FIT = 2, 5000, 1000
SETUP = {"check_inputs_s": 1.0, "load_model_s": 20.0, "shard_model_s": 4.0, "read_inputs_s": 3.0}
DIRECTION, SCORES = 30.0, 1000.0
FACTORS, EIGH, LAMBDA = 300.0, 100.0, 200.0
REST = 7.0  # the curvature's time outside its three phases (damping, saving): projected as measured


def _module():
    spec = importlib.util.spec_from_file_location("scale_report", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run_dir(root: Path, name: str = "run-stream", **drop) -> Path:
    r = {"memory_plan": {"peak": 3 * GiB, "scoring": {"batch_size": 16}, "notes": ["streamed"]},
         "gpu_peak_bytes": 2 * GiB,
         "timings": {**SETUP, "preference_s": DIRECTION, "curvature_s": FACTORS + EIGH + LAMBDA + REST,
                     "scores_s": SCORES, "total_s": 2000.0},
         "curvature": {"groups": 4, "store": "disk",
                       "phases_s": {"factors_s": FACTORS, "eigh_s": EIGH, "lambda_s": LAMBDA}},
         "model": {"device": "cuda:0"}, "tracked_modules": ["a", "b", "c"],
         "counts": {"pool": POOL, "pairs": 40},
         "distributed": {"world_size": WORLD}, "fit_sample": {"tokenised": FIT}}
    for k in drop:
        r.pop(k)
    d = root / name
    d.mkdir(parents=True)
    (d / "run.json").write_text(json.dumps(r))
    return d


def _approx(x):
    return pytest.approx(x, rel=REL_TOL)


def test_row_reads_the_run(tmp_path):
    r = _module().row(_run_dir(tmp_path))
    assert (r["run"], r["device"], r["tracked_layers"], r["pool"], r["pairs"]) == ("run-stream", "cuda:0", 3, POOL, 40)
    assert (r["world"], r["fit_examples"], r["groups"], r["store"]) == (WORLD, FIT, 4, "disk")
    assert r["setup_s"] == _approx(sum(SETUP.values()))
    assert (r["fit_factors_s"], r["eigh_s"], r["fit_lambda_s"]) == (FACTORS, EIGH, LAMBDA)
    assert r["plan_peak_gib"] == _approx(3.0) and r["gpu_peak_gib"] == _approx(2.0)
    assert r["split_half_s"] is None  # not measured in this run
    # a single-process run without a fit sample: one GPU, the whole pool
    bare = _module().row(_run_dir(tmp_path, "bare", distributed=None, fit_sample=None))
    assert (bare["world"], bare["fit_examples"]) == (1, POOL)


def test_projection_against_hand_arithmetic(tmp_path):
    mod = _module()
    r = mod.row(_run_dir(tmp_path))
    setup = sum(SETUP.values())
    # the run's own GPU count, fit sample and pool: the measured stage times, efficiency not applied
    own = mod.project(r, POOL, [WORLD], efficiency=0.5)[str(WORLD)]
    assert own["fit_s"] == _approx(FACTORS + EIGH + LAMBDA + REST)
    assert own["scores_s"] == _approx(SCORES)
    assert (own["setup_s"], own["direction_s"], own["split_half_s"], own["select_s"]) == (setup, DIRECTION, 0, 0)
    assert own["total_s"] == _approx(setup + DIRECTION + FACTORS + EIGH + LAMBDA + REST + SCORES)
    # twice the GPUs: fit and scoring halved, then divided by the efficiency; the rest unchanged
    eff = 0.8
    p = mod.project(r, POOL, [WORLD, 2 * WORLD, 1], efficiency=eff)
    assert set(p) == {str(WORLD), str(2 * WORLD), "1"}
    two = p[str(2 * WORLD)]
    assert two["fit_s"] == _approx((FACTORS + EIGH + LAMBDA) / 2 / eff + REST)
    assert two["scores_s"] == _approx(SCORES / 2 / eff)
    assert (two["setup_s"], two["direction_s"]) == (setup, DIRECTION)
    # fewer GPUs than the run's: twice the time, and the efficiency applies there too
    assert p["1"]["fit_s"] == _approx((FACTORS + EIGH + LAMBDA) * 2 / eff + REST)
    assert p["1"]["scores_s"] == _approx(SCORES * 2 / eff)
    # a fit sample 10 times the run's: the two passes x10, the eigendecompositions unchanged
    big = mod.project(r, POOL, [WORLD], efficiency=eff, fit_examples=10 * FIT)[str(WORLD)]
    assert big["fit_s"] == _approx(10 * (FACTORS + LAMBDA) + EIGH + REST)
    assert big["scores_s"] == _approx(SCORES)
    # 10 times the pool: scoring and select x10, the fit not (its sample is fixed)
    n = 10 * POOL
    grown = mod.project(r, n, [WORLD, 2 * WORLD], efficiency=eff, select_s=8.0)
    assert grown[str(WORLD)]["scores_s"] == _approx(10 * SCORES)
    assert grown[str(WORLD)]["select_s"] == _approx(80.0)
    assert grown[str(2 * WORLD)]["select_s"] == _approx(80.0)  # select runs on one process: no GPU scaling
    assert grown[str(WORLD)]["fit_s"] == _approx(FACTORS + EIGH + LAMBDA + REST)
    for k, v in {**grown, **p}.items():
        stages = [v[s] for s in ("setup_s", "direction_s", "split_half_s", "fit_s", "scores_s", "select_s")]
        assert set(v) == {"setup_s", "direction_s", "split_half_s", "fit_s", "scores_s", "select_s", "total_s"}
        assert v["total_s"] == _approx(sum(stages)), k
    all_at_once = grown[str(2 * WORLD)]
    assert all_at_once["total_s"] == _approx(setup + DIRECTION + (FACTORS + EIGH + LAMBDA) / 2 / eff + REST
                                             + 10 * SCORES / 2 / eff + 80.0)


def test_main_writes_the_projection(tmp_path):
    d = _run_dir(tmp_path)
    (tmp_path / "no-run").mkdir()  # a folder without run.json is skipped
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), str(d), str(tmp_path / "no-run"), "--project", str(10 * POOL),
                           "--gpus", str(WORLD), str(2 * WORLD), "--efficiency", "0.8", "--fit-examples",
                           str(10 * FIT), "--select-s", "8", "--json", str(out)],
                          capture_output=True, text=True, check=True)
    rows = json.loads(out.read_text())
    assert [r["run"] for r in rows] == ["run-stream"]
    p = rows[0]["projected_s"]
    assert (p["records"], p["efficiency"], p["fit_examples"]) == (10 * POOL, 0.8, 10 * FIT)
    assert set(p["by_gpus"]) == {str(WORLD), str(2 * WORLD)}
    four = p["by_gpus"][str(2 * WORLD)]
    assert four["fit_s"] == _approx((10 * (FACTORS + LAMBDA) + EIGH) / 2 / 0.8 + REST)
    assert four["scores_s"] == _approx(10 * SCORES / 2 / 0.8)
    assert four["select_s"] == _approx(80.0)
    own = p["by_gpus"][str(WORLD)]
    assert own["fit_s"] == _approx(10 * (FACTORS + LAMBDA) + EIGH + REST) and own["scores_s"] == _approx(10 * SCORES)
    assert "run-stream (measured on 2 GPU(s)): projected for 50000 records, fit sample 10000" in proc.stdout
    # without --project: the table only, no projection
    subprocess.run([sys.executable, str(SCRIPT), str(d), "--json", str(out)], capture_output=True, check=True)
    assert "projected_s" not in json.loads(out.read_text())[0]
