"""benchmarks/moe_scale.py's CPU path on its tiny shape: the score run, the training steps
and the JSON it writes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_moe_scale_runs_on_the_cpu_tiny_shape(tmp_path):
    out = tmp_path / "moe"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "moe_scale.py"), "--shape", "tiny", "--layers", "1",
                    "--pool", "12", "--targets", "2", "--max-length", "96", "--train-steps", "1",
                    "--train-batch", "2", "--out", str(out), "--json", str(tmp_path / "r.json")],
                   check=True, capture_output=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["pool"] == 12 and r["tracking"]["kinds"]["expert linear"]["modules"] == 2 * 4
    assert r["scoring_ex_per_s"] > 0 and r["train_fused"]["ex_per_s"] > 0 and r["train_eager"]["ex_per_s"] > 0
    assert r["fit_phases_s"]["factors_s"] >= 0
