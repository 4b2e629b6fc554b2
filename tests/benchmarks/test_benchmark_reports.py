"""The report modes of the benchmarks that read finished runs (no model, no data)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(res: dict, device: str, seeds: range, sizes: tuple, delta: float) -> dict:
    """A small_pools result file: identity ``delta`` above EK-FAC on every pool."""
    runs = [{"family": "mistake-math", "n": n, "seed": s, "ratio": 0.1,
             "auroc": {"identity": 0.7 + delta, "ekfac": 0.7, "ekfac damping-noise": 0.71}}
            for n in sizes for s in seeds]
    return {**res, "device": device, "runs": runs}


def test_small_pools_report_keeps_devices_apart_and_plots_the_paired_differences(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_run({}, "NVIDIA H200", range(3), (60, 300), 0.02)))
    b.write_text(json.dumps(_run({}, "cpu", range(2), (60,), -0.05)))
    png = tmp_path / "p.png"
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "small_pools.py"), "--report", str(a), str(b),
                          "--variants", "identity", "ekfac", "ekfac damping-noise", "--plot", str(png)],
                         capture_output=True, text=True, check=True).stdout
    assert "| H200 | mistake-math | 60 | 0.1 | 3 | 0.720 +- 0.000 | 0.700 +- 0.000 | 0.710 +- 0.000 |" in out
    assert "| cpu | mistake-math | 60 | 0.1 | 2 | 0.650 +- 0.000 |" in out  # not merged with the H200 seeds
    assert "| H200 | mistake-math | 300 | 0.1 | 3 | +0.020 [+0.020, +0.020] | +0.010 [+0.010, +0.010] |" in out
    assert png.stat().st_size > 0 and png.read_bytes()[:4] == b"\x89PNG"
    # the CPU pools have one size: no panel for them, and with only those, nothing drawn
    spec = importlib.util.spec_from_file_location("small_pools", ROOT / "benchmarks" / "small_pools.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.plot([str(b)], str(tmp_path / "none.png"))
    assert not (tmp_path / "none.png").exists()


def test_fit_sample_report_compares_every_fit_with_the_whole_pools(tmp_path):
    """Spearman and top-10% overlap against the whole-pool run, AUROC of the harmful flag."""
    ids = [f"r{i}" for i in range(20)]
    harmful = {i: k < 4 for k, i in enumerate(ids)}
    (tmp_path / "pool.jsonl").write_text("".join(json.dumps({"id": i, "prompt": "q", "response": "a",
                                                             "harmful": harmful[i]}) + "\n" for i in ids))
    (tmp_path / "pool_info.json").write_text(json.dumps({"records": 20}))
    whole = {i: 20.0 - k for k, i in enumerate(ids)}  # the harmful records first: AUROC 1
    flipped = {i: -s for i, s in whole.items()}  # reversed: Spearman -1, AUROC 0, no top record shared
    for name, scores, fit in (("whole", whole, None), ("fit10-seed0", flipped, 10)):
        d = tmp_path / "runs" / name
        d.mkdir(parents=True)
        ranked = sorted(scores.items(), key=lambda kv: -kv[1])
        (d / "scores.jsonl").write_text("".join(json.dumps({"id": i, "score": s, "rank": r + 1}) + "\n"
                                                for r, (i, s) in enumerate(ranked)))
        (d / "run.json").write_text(json.dumps({"curvature_settings": {"fit_examples": fit},
                                                "timings": {"curvature_s": 2.0, "total_s": 5.0}}))
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fit_sample.py"), "report", "--out", str(tmp_path),
                          "--json", str(tmp_path / "r.json")], capture_output=True, text=True, check=True).stdout
    assert "| whole | 1.0000 | 1.000 | 1.000 | 2.0 | 5.0 |" in out
    assert "| fit10-seed0 | -1.0000 | 0.000 | 0.000 | 2.0 | 5.0 |" in out
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert [r["fit_examples"] for r in rows] == [None, 10]


def test_fit_sample_runs_put_the_whole_pool_first_unless_another_process_runs_it():
    spec = importlib.util.spec_from_file_location("fit_sample", ROOT / "benchmarks" / "fit_sample.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.planned_runs([200, 100], [0, 1]) == [("whole", 0), (200, 0), (100, 0), (200, 1), (100, 1)]
    assert mod.planned_runs([100], [3], whole=False) == [(100, 3)]
