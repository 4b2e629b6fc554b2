"""Tabulate scale-suite runs: for each run directory, the memory plan next to the measured
peak, and the time of each stage (from run.json). Prints a table and writes JSON.

    python benchmarks/scale_report.py /tmp/s/run-full /tmp/s/run-lora --json out.json
    python benchmarks/scale_report.py /tmp/s/run-stream --project 270000 --gpus 4 8 --efficiency 0.9 \
        --fit-examples 10000 --select-s 8

``--project N`` adds each run's projected time for a pool of N records on each number of
GPUs in ``--gpus``, from the run's own stage times on its own GPU count (run.json's world
size, W):

* model load and sharding, the direction and the split-half check: as measured;
* the fit: its two passes (factors, eigenvalues) scaled by F / the run's fit sample
  (``--fit-examples F``, default the run's own) and by W / GPUs, the eigendecompositions
  (spread over the ranks) by W / GPUs, the rest of the curvature's time as measured;
* scoring and ``select`` (``--select-s``, measured separately): scaled by N / pool, and
  scoring by W / GPUs;
* then divided by ``--efficiency`` where the GPU count differs from W (the per-GPU
  efficiency of that change, measured separately).

A projection, not a measurement.
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
        "world": (r.get("distributed") or {}).get("world_size", 1),
        "fit_examples": (r.get("fit_sample") or {}).get("tokenised") or r["counts"]["pool"],
        "setup_s": sum(t.get(k) or 0 for k in ("check_inputs_s", "load_model_s", "shard_model_s", "read_inputs_s")),
    }


def project(r: dict, n: int, gpus: list, efficiency: float, fit_examples: int | None = None,
            select_s: float = 0.0) -> dict:
    """Projected seconds for ``n`` records on each GPU count (see the module docstring),
    by stage and in total."""
    w, fit_n = r["world"], fit_examples or r["fit_examples"]
    passes = (r["fit_factors_s"] or 0) + (r["fit_lambda_s"] or 0)
    # the curvature's time outside its three phases (damping, saving): kept as measured
    rest = max(0.0, (r["curvature_s"] or 0) - passes - (r["eigh_s"] or 0))
    out = {}
    for k in gpus:
        eff = 1.0 if k == w else efficiency
        st = {"setup_s": r["setup_s"], "direction_s": r["direction_s"] or 0, "split_half_s": r["split_half_s"] or 0,
              "fit_s": (passes * fit_n / r["fit_examples"] + (r["eigh_s"] or 0)) * w / (k * eff) + rest,
              "scores_s": (r["scores_s"] or 0) * n / r["pool"] * w / (k * eff),
              "select_s": select_s * n / r["pool"]}
        out[str(k)] = {**st, "total_s": sum(st.values())}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--json")
    ap.add_argument("--project", type=int, metavar="N", help="project each run to a pool of N records")
    ap.add_argument("--gpus", type=int, nargs="+", default=[1], help="GPU counts of the projection")
    ap.add_argument("--efficiency", type=float, default=1.0,
                    help="per-GPU efficiency of going from the run's GPU count to another (measured)")
    ap.add_argument("--fit-examples", type=int, help="the projected run's fit sample (default: the run's own)")
    ap.add_argument("--select-s", type=float, default=0.0,
                    help="the run's measured `select` time, scaled with the pool")
    a = ap.parse_args()
    rows = [row(Path(d)) for d in a.runs if (Path(d) / "run.json").exists()]
    if a.project:
        for r in rows:
            r["projected_s"] = {"records": a.project, "efficiency": a.efficiency,
                                "fit_examples": a.fit_examples or r["fit_examples"],
                                "by_gpus": project(r, a.project, a.gpus, a.efficiency, a.fit_examples, a.select_s)}
    cols = ["run", "tracked_layers", "groups", "store", "plan_peak_gib", "gpu_peak_gib", "direction_s",
            "fit_factors_s", "eigh_s", "fit_lambda_s", "scores_s", "total_s"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.1f}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    for r in rows:
        if "projected_s" in r:
            p = r["projected_s"]
            print(f"{r['run']} (measured on {r['world']} GPU(s)): projected for {p['records']} records, fit sample "
                  f"{p['fit_examples']}, efficiency {p['efficiency']:g}: "
                  + ", ".join(f"{k} GPU(s) {v['total_s'] / 3600:.2f} h (fit {v['fit_s']:.0f} s, scoring "
                              f"{v['scores_s']:.0f} s)" for k, v in p["by_gpus"].items()))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
