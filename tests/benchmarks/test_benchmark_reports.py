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
