"""How the curvature's fit sample moves the ranking: one real pool scored with EK-FAC fitted
on the whole pool and on seeded samples of 1K, 2K, 5K and 10K of its records
(``prism-select score --fit-examples N``, default flags otherwise, the embedded model).

The pool (``build``): GSM8K training solutions, 10% of them corrupted as in mistake math
(a calculator step's result changed and carried to the final answer; ``harmful: true``),
and every BIG-Bench-Hard example answered with its reference (clean), about 12,500
records; 32 counterfactual target pairs on GSM8K problems outside the pool (chosen = a
corrupted solution, rejected = the correct one).

For each run (``report``): Spearman of its scores against the whole-pool fit's, the
share of the whole-pool fit's top 10% that it also puts in its top 10%, the ranking
AUROC of the harmful flag, the fit's and the whole run's seconds (from ``run.json``).
Sizes below the pool's are run with ``--seeds`` (other fit samples of the same size).

    python benchmarks/fit_sample.py build --data ../shared/data --out /tmp/fs
    python benchmarks/fit_sample.py run --out /tmp/fs [--sizes 10000 5000 2000 1000] [--seeds 0 1]
    python benchmarks/fit_sample.py report --out /tmp/fs --json fit_sample.json --markdown fit_sample.md

``run`` skips runs whose ``run.json`` exists (a stopped run resumes) and runs the
whole-pool fit first (the reference of every row); with ``--no-whole`` it leaves that fit
to another process, so that one process per GPU can share the folder (each with its own
``--sizes``).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prism_select.evaluation.builders.bbh import read_bbh_dir  # noqa: E402
from prism_select.evaluation.builders.common import write_records  # noqa: E402
from prism_select.evaluation.builders.gsm8k import mistake_math_pool, mistake_math_targets  # noqa: E402
from prism_select.evaluation.experiment import read_jsonl  # noqa: E402
from prism_select.evaluation_metrics import auroc  # noqa: E402
from prism_select.metrics import spearman  # noqa: E402
from prism_select.selection import read_scores  # noqa: E402

GSM8K_RECORDS = 5500
HARMFUL_RATIO = 0.1
TARGET_PAIRS = 32
TOP_FRACTION = 0.1
WHOLE = "whole"


def build(data: Path, out: Path, seed: int = 0) -> dict:
    train = data / "gsm8k" / "train.jsonl"
    pool = mistake_math_pool(train, GSM8K_RECORDS, HARMFUL_RATIO, seed)
    targets = mistake_math_targets(train, TARGET_PAIRS, seed, exclude=pool)
    for task, examples in sorted(read_bbh_dir(data / "bbh").items()):
        pool += [{"id": f"{task}-{i}", "prompt": e["input"], "response": str(e["target"]).strip(),
                  "harmful": False, "task": task} for i, e in enumerate(examples)]
    random.Random(f"fit-sample-pool:{seed}").shuffle(pool)
    out.mkdir(parents=True, exist_ok=True)
    write_records(out / "pool.jsonl", pool)
    write_records(out / "targets.jsonl", targets)
    info = {"records": len(pool), "harmful": sum(r["harmful"] for r in pool), "target_pairs": len(targets),
            "gsm8k_records": GSM8K_RECORDS, "bbh_records": len(pool) - GSM8K_RECORDS}
    (out / "pool_info.json").write_text(json.dumps(info, indent=1))
    return info


def run_name(size, seed: int) -> str:
    return WHOLE if size == WHOLE else f"fit{size}-seed{seed}"


def planned_runs(sizes: list, seeds: list, whole: bool = True) -> list:
    """``(size, seed)`` of each run in order: the whole-pool fit first (unless ``whole`` is
    false: another process runs it), then every size for each seed."""
    return ([(WHOLE, 0)] if whole else []) + [(n, s) for s in seeds for n in sizes]


def run(out: Path, sizes: list, seeds: list, extra: list, whole: bool = True) -> None:
    for size, seed in planned_runs(sizes, seeds, whole):
        d = out / "runs" / run_name(size, seed)
        if (d / "run.json").is_file():
            continue
        cmd = [sys.executable, "-m", "prism_select.cli", "score", "--model", "default",
               "--pool", str(out / "pool.jsonl"), "--targets", str(out / "targets.jsonl"), "--out", str(d),
               "--cache-dir", str(out / "cache"), "--seed", str(seed), "--no-progress", *extra]
        if size != WHOLE:
            cmd += ["--fit-examples", str(size)]
        t0 = time.perf_counter()
        rc = subprocess.call(cmd)
        print(f"{run_name(size, seed)}: exit {rc} after {time.perf_counter() - t0:.0f} s", flush=True)
        if rc:
            raise SystemExit(rc)


def _top(scores: dict, k: int) -> set:
    return set(sorted(scores, key=lambda i: -scores[i])[:k])


def report(out: Path) -> dict:
    # read by lines: str.splitlines() would also split inside records holding U+2028 and kin
    pool = {r["id"]: r for r in read_jsonl(out / "pool.jsonl")}
    runs = {}
    for d in sorted((out / "runs").iterdir()):
        if (d / "run.json").is_file():
            runs[d.name] = ({r["id"]: r["score"] for r in read_scores(d / "scores.jsonl")},
                            json.loads((d / "run.json").read_text()))
    if WHOLE not in runs:
        raise SystemExit(f"no finished whole-pool run in {out / 'runs'}")
    ref = runs[WHOLE][0]
    ids = sorted(ref)
    k = max(1, round(TOP_FRACTION * len(ids)))
    rows = []
    for name, (scores, meta) in sorted(runs.items(), key=lambda kv: (kv[0] != WHOLE, kv[0])):
        timings = meta.get("timings", {})
        rows.append({"run": name, "fit_examples": meta.get("curvature_settings", {}).get("fit_examples"),
                     "spearman_vs_whole": spearman([scores[i] for i in ids], [ref[i] for i in ids]),
                     "top10_overlap_with_whole": len(_top(scores, k) & _top(ref, k)) / k,
                     "auroc": auroc([scores[i] for i in ids], [bool(pool[i]["harmful"]) for i in ids]),
                     "curvature_s": timings.get("curvature_s"), "total_s": timings.get("total_s"),
                     "eigenvalue_pass_s": meta.get("curvature", {}).get("phases_s", {}).get("lambda_s")})
    return {"pool": json.loads((out / "pool_info.json").read_text()), "rows": rows}


def markdown(res: dict) -> str:
    lines = ["| fit sample | Spearman vs whole pool | top 10% shared with whole | AUROC (harmful) | curvature s | run s |",
             "|---|---|---|---|---|---|"]
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for r in res["rows"]:
        lines.append(f"| {r['run']} | {r['spearman_vs_whole']:.4f} | {r['top10_overlap_with_whole']:.3f} | "
                     f"{r['auroc']:.3f} | {fmt(r['curvature_s'], '.1f')} | {fmt(r['total_s'], '.1f')} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("step", choices=["build", "run", "report"])
    ap.add_argument("--out", required=True, help="work folder: pool, targets, runs/")
    ap.add_argument("--data", help="build: the folder holding gsm8k/train.jsonl and bbh/")
    ap.add_argument("--sizes", type=int, nargs="+", default=[10000, 5000, 2000, 1000])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--no-whole", action="store_true",
                    help="run: leave out the whole-pool fit (another process on another GPU runs it)")
    ap.add_argument("--json", help="report: write the rows here")
    ap.add_argument("--markdown", help="report: write the table here")
    a, extra = ap.parse_known_args()
    out = Path(a.out)
    if a.step == "build":
        if not a.data:
            ap.error("build needs --data")
        print(json.dumps(build(Path(a.data), out)))
    elif a.step == "run":
        run(out, a.sizes, a.seeds, extra, whole=not a.no_whole)
    else:
        res = report(out)
        text = markdown(res)
        print(text)
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=1))
        if a.markdown:
            Path(a.markdown).write_text(text)


if __name__ == "__main__":
    main()
