"""Tabulate scale-suite runs: for each run directory, the memory plan next to the measured
peak, and the time of each stage (from run.json). Prints a table and writes JSON.

    python benchmarks/scale_report.py /tmp/s/run-full /tmp/s/run-lora --json out.json
    python benchmarks/scale_report.py /tmp/s/run-stream --project 270000 --gpus 4 8 --efficiency 0.85

``--project N`` adds each run's projected time for a pool of N records on each number of
GPUs in ``--gpus``: the measured direction, curvature and split-half check (a streamed run fits on a
sample of fixed size, so they do not grow with the pool) plus the measured scoring time scaled by
N / pool and divided by GPUs x efficiency (the scoring's per-GPU efficiency, measured
separately). A projection, not a measurement.
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
        "curvature_s": t.get("curvature_s"), "split_half_s": t.get("split_half_s"),
        "scores_s": t.get("scores_s"), "total_s": t.get("total_s"),
        "scoring_batch": plan.get("scoring", {}).get("batch_size"), "notes": plan.get("notes", []),
    }


def project(r: dict, n: int, gpus: list, efficiency: float) -> dict:
    """Projected seconds for ``n`` records on each GPU count (see the module docstring)."""
    fixed = (r["direction_s"] or 0) + (r["curvature_s"] or 0) + (r["split_half_s"] or 0)
    per_record = (r["scores_s"] or 0) / r["pool"]
    return {str(k): fixed + per_record * n / (k * efficiency) for k in gpus}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--json")
    ap.add_argument("--project", type=int, metavar="N", help="project each run to a pool of N records")
    ap.add_argument("--gpus", type=int, nargs="+", default=[1], help="GPU counts of the projection")
    ap.add_argument("--efficiency", type=float, default=1.0, help="scoring efficiency per GPU (measured)")
    a = ap.parse_args()
    rows = [row(Path(d)) for d in a.runs if (Path(d) / "run.json").exists()]
    if a.project:
        for r in rows:
            r["projected_s"] = {"records": a.project, "efficiency": a.efficiency,
                                "by_gpus": project(r, a.project, a.gpus, a.efficiency)}
    cols = ["run", "tracked_layers", "groups", "store", "plan_peak_gib", "gpu_peak_gib", "direction_s",
            "fit_factors_s", "eigh_s", "fit_lambda_s", "scores_s", "total_s"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.1f}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    for r in rows:
        if "projected_s" in r:
            p = r["projected_s"]
            print(f"{r['run']}: projected for {p['records']} records (scoring efficiency {p['efficiency']:g}): "
                  + ", ".join(f"{k} GPU(s) {v / 3600:.2f} h" for k, v in p["by_gpus"].items()))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
