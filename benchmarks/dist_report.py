"""Compare runs of the same `score` command with 1, 2, 4... processes: scaling efficiency
of the curvature fit and of scoring, and agreement of the scores with the first run.

    python benchmarks/dist_report.py RUN_1GPU RUN_2GPU RUN_4GPU [--json out.json]
"""

import argparse
import json
from pathlib import Path

import torch


def load(run):
    run = Path(run)
    meta = json.loads((run / "run.json").read_text())
    scores = {}
    for line in (run / "scores.jsonl").read_text().splitlines():
        r = json.loads(line)
        scores[r["id"]] = r["score"]
    return meta, scores


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    base_meta, base = load(a.runs[0])
    ids = list(base)
    b = torch.tensor([base[i] for i in ids], dtype=torch.float64)
    rows = []
    t1 = None
    for run in a.runs:
        meta, sc = load(run)
        k = meta.get("distributed", {}).get("world_size", 1)
        s = torch.tensor([sc[i] for i in ids], dtype=torch.float64)
        tm = meta["timings"]
        fit, score = tm.get("curvature_s", float("nan")), tm.get("scores_s", float("nan"))
        if t1 is None:
            t1 = (fit, score, k)
        row = {"run": str(run), "gpus": k, "curvature_s": fit, "scores_s": score,
               "fit_efficiency": t1[0] * t1[2] / (fit * k), "score_efficiency": t1[1] * t1[2] / (score * k),
               "fit_plus_score_efficiency": (t1[0] + t1[1]) * t1[2] / ((fit + score) * k),
               "max_rel_diff_vs_first": float((s - b).abs().max() / b.abs().max()),
               "pool": len(ids), "throughput": meta.get("throughput"),
               "fit_phases_s": meta.get("curvature", {}).get("phases_s")}
        rows.append(row)
    print("| GPUs | curvature fit s | scoring s | fit eff. | scoring eff. | fit+score eff. | max |diff| / max |score| |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['gpus']} | {r['curvature_s']:.2f} | {r['scores_s']:.2f} | {r['fit_efficiency']:.3f} | "
              f"{r['score_efficiency']:.3f} | {r['fit_plus_score_efficiency']:.3f} | {r['max_rel_diff_vs_first']:.2e} |")
    for r in rows:
        if r["fit_phases_s"]:
            print(f"{r['gpus']} GPU(s), fit phases: " + ", ".join(f"{k} {v:.2f}" for k, v in r["fit_phases_s"].items()))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
