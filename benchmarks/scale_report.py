"""Tabulate scale-suite runs: for each run directory, the memory plan next to the measured
peak, and the time of each stage (from run.json). Prints a table and writes JSON.

    python benchmarks/scale_report.py /tmp/s/run-full /tmp/s/run-lora --json out.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

GiB = 1 << 30


def row(d: Path) -> dict:
    r = json.loads((d / "run.json").read_text())
    plan = r.get("memory_plan", {})
    t = r["timings"]
    cur = r.get("curvature", {})
    ph = cur.get("phases_s", {})
    return {
        "run": d.name, "device": r["model"]["device"], "tracked_layers": len(r["tracked_modules"]),
        "pool": r["counts"]["pool"], "pairs": r["counts"]["pairs"],
        "groups": cur.get("groups"), "store": cur.get("store"),
        "plan_peak_gib": plan.get("peak", 0) / GiB, "gpu_peak_gib": r.get("gpu_peak_bytes", 0) / GiB,
        "load_s": t.get("load_model_s"), "direction_s": t.get("preference_s"),
        "fit_factors_s": ph.get("factors_s"), "eigh_s": ph.get("eigh_s"), "fit_lambda_s": ph.get("lambda_s"),
        "curvature_s": t.get("curvature_s"), "scores_s": t.get("scores_s"), "total_s": t.get("total_s"),
        "scoring_batch": plan.get("scoring", {}).get("batch_size"), "notes": plan.get("notes", []),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = [row(Path(d)) for d in a.runs if (Path(d) / "run.json").exists()]
    cols = ["run", "tracked_layers", "groups", "store", "plan_peak_gib", "gpu_peak_gib", "direction_s",
            "fit_factors_s", "eigh_s", "fit_lambda_s", "scores_s", "total_s"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.1f}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
