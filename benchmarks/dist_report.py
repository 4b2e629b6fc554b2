"""Compare runs of the same `score` command with 1, 2, 4... processes (data-parallel ranks
or `--shard fsdp`): scaling efficiency of the target direction, the curvature fit and
scoring, agreement of the scores with the first run (Spearman, largest difference), and
the GPU memory each rank held (the model after loading/sharding, and the peak).

    python benchmarks/dist_report.py RUN_1GPU RUN_2GPU RUN_4GPU [--agree-with I] [--json out.json]

Efficiency is one GPU's time / (K x time) on the work itself: the target direction, the
fit's three phases (factors, eigendecompositions, eigenvalues; not the writing of the
curvature to the cache, which a sharded run does not do) and scoring. Agreement is
measured against run ``--agree-with`` (default the first).
"""

import argparse
import json
from pathlib import Path

import torch

from prism_select.metrics import spearman


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
    ap.add_argument("--agree-with", type=int, default=0, help="index of the run the scores are compared with")
    a = ap.parse_args()
    base_meta, base = load(a.runs[a.agree_with])
    ids = list(base)
    b = torch.tensor([base[i] for i in ids], dtype=torch.float64)
    rows = []
    t1 = None
    for run in a.runs:
        meta, sc = load(run)
        k = meta.get("distributed", {}).get("world_size", 1)
        s = torch.tensor([sc[i] for i in ids], dtype=torch.float64)
        tm = meta["timings"]
        phases = meta.get("curvature", {}).get("phases_s") or {}
        fit = sum(phases.values()) if phases else tm.get("curvature_s", float("nan"))
        score = tm.get("scores_s", float("nan"))
        pref = tm.get("preference_s", 0.0)
        work = pref + fit + score
        if t1 is None:
            t1 = (fit, score, k, work)
        mem = meta.get("gpu_bytes_per_rank") or {}
        row = {"run": str(run), "gpus": k, "shard": meta.get("settings", {}).get("shard", "none"),
               "preference_s": pref, "curvature_s": tm.get("curvature_s"), "fit_phases_total_s": fit,
               "scores_s": score, "work_s": work,
               "fit_efficiency": t1[0] * t1[2] / (fit * k), "score_efficiency": t1[1] * t1[2] / (score * k),
               "fit_plus_score_efficiency": (t1[0] + t1[1]) * t1[2] / ((fit + score) * k),
               "efficiency": t1[3] * t1[2] / (work * k),
               "agree_with": str(a.runs[a.agree_with]),
               "spearman_vs_first": spearman(b.tolist(), s.tolist()),
               "max_rel_diff_vs_first": float((s - b).abs().max() / b.abs().max()),
               "model_gib_per_rank": [x / 2**30 for x in mem.get("model") or []],
               "peak_gib_per_rank": [x / 2**30 for x in mem.get("peak") or []],
               "factor_gib_per_rank": [x / 2**30 for x in (meta.get("curvature", {}).get("factor_shards") or {})
                                       .get("stored_bytes_per_rank", [])],
               "pool": len(ids), "throughput": meta.get("throughput"),
               "fit_phases_s": meta.get("curvature", {}).get("phases_s")}
        rows.append(row)
    print(f"agreement against {a.runs[a.agree_with]}")
    print("| run | GPUs | shard | direction s | fit phases s (stage s) | scoring s | efficiency (all three) | "
          "fit eff. | scoring eff. | Spearman | max |diff| / max |score| | model GiB/rank | curvature GiB/rank | "
          "peak GiB/rank |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        gib = lambda xs: "/".join(f"{x:.1f}" for x in xs) or "-"  # noqa: E731
        print(f"| {Path(r['run']).name} | {r['gpus']} | {r['shard']} | {r['preference_s']:.1f} | "
              f"{r['fit_phases_total_s']:.1f} ({r['curvature_s'] or float('nan'):.1f}) | "
              f"{r['scores_s']:.1f} | {r['efficiency']:.3f} | {r['fit_efficiency']:.3f} | {r['score_efficiency']:.3f} | "
              f"{r['spearman_vs_first']:.5f} | {r['max_rel_diff_vs_first']:.2e} | "
              f"{gib(r['model_gib_per_rank'])} | {gib(r['factor_gib_per_rank'])} | {gib(r['peak_gib_per_rank'])} |")
    for r in rows:
        if r["fit_phases_s"]:
            print(f"{r['gpus']} GPU(s) {r['shard']}, fit phases: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in r["fit_phases_s"].items()))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
