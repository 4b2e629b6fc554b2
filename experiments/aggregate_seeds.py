"""Combine the results.json files of a select experiment run one seed per call.

`prism-select experiment select --seeds 0 1 2` aggregates the seeds it runs in one output
folder. When each seed ran in its own device call, only its results.json comes back
(the adapters stay on the machine, so a rerun here would fine-tune again); this script
merges those files with `general_selection.combine_seeds` (the same tables, mean and
sample std over seeds, as the experiment writes), writes the JSON and prints a Markdown
table: each seed's value, mean +- std, and the paired differences from some rows (the seeds
share their pool and probes within a seed, so row minus row is taken seed by seed; they
go to the JSON too, under ``paired_differences``), and, for a multitask pool, how the
target-task share of a selection goes with its gain over random (``share_vs_gain``).

    python experiments/aggregate_seeds.py docs/results/multitask-select/seed{0,1,2}/results.json \
        --allow score.max_length finetune.overrides.max_length \
        --out docs/results/multitask-select/results-3seeds.json
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from prism_select.errors import run_script
from prism_select.evaluation.experiment import paired_interval
from prism_select.evaluation.general_selection import combine_seeds, read_results
from prism_select.io import atomic_write_json


def _f(v, digits=3):
    return "-" if v is None else f"{v:.{digits}f}"


def _ms(c):
    if c["mean"] is None:
        return "-"
    return _f(c["mean"]) + ("" if c["std"] is None else f" +- {_f(c['std'])}")


def _ci(c):
    if c["mean"] is None:
        return "-"
    return f"{c['mean']:+.3f}" + ("" if not c.get("ci") else f" [{c['ci'][0]:+.3f}, {c['ci'][1]:+.3f}]")


def paired(res: dict, against: str, task: str = "mean", metric: str = "accuracy") -> dict:
    """Each ``metric`` row minus the row ``against``, seed by seed: ``{row: paired_interval}``
    (mean, std and a 95% t interval over the seeds)."""
    out = {}
    for label in dict.fromkeys(k for r in res["runs"] for k in r.get(metric) or {}):
        if label == against:
            continue
        d = []
        for r in res["runs"]:
            a, b = (((r.get(metric) or {}).get(k) or {}).get(task) for k in (label, against))
            d.append(None if a is None or b is None else a - b)
        out[label] = paired_interval(d)
    return out


def share_vs_gain(res: dict, against: str = "random", task: str = "mean") -> dict | None:
    """Pearson r, over every (method, seed), between the target-task share of the
    selection and its accuracy minus ``against``'s in that seed (None without shares)."""
    xs, ys = [], []
    for r in res["runs"]:
        ref = (r["accuracy"].get(against) or {}).get(task)
        for m, sh in (r.get("target_task_share") or {}).items():
            a = (r["accuracy"].get(m) or {}).get(task)
            if m != against and sh is not None and a is not None and ref is not None:
                xs.append(sh)
                ys.append(a - ref)
    if len(xs) < 3:
        return None
    try:
        r = statistics.correlation(xs, ys)
    except statistics.StatisticsError:  # a constant share or gain: no correlation to state
        r = None
    return {"against": against, "n": len(xs), "pearson_r": r}


def markdown(res: dict, against: list, task: str = "mean", metric: str = "accuracy") -> str:
    """The ``metric`` table (column ``task``): each seed, mean +- std, the paired
    differences from the rows ``against`` (mean [95% t interval]), and the target-task
    share beside it."""
    runs = res["runs"]
    seeds = [r["seed"] for r in runs]
    acc = next(t for t in res["tables"] if t["name"] == metric)
    share = {r["label"]: r["cells"][0] for t in res["tables"] if t["name"] == "target_task_share" for r in t["rows"]}
    col = acc["columns"].index(task)
    diffs = {a: paired(res, a, task, metric) for a in against}
    head = (["row"] + [f"seed {s}" for s in seeds] + [f"mean +- std ({len(seeds)})"]
            + [f"minus {a}, paired" for a in against] + (["target-task share, per seed; mean"] if share else []))
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in acc["rows"]:
        label = row["label"]
        vals = [((r.get(metric) or {}).get(label) or {}).get(task) for r in runs]
        out = [label] + [_f(v, 2) for v in vals] + [_ms(row["cells"][col])]
        out += ["-" if label == a else _ci(diffs[a][label]) for a in against]
        if share:
            c = share.get(label)
            out.append("-" if not c or c["mean"] is None else
                       " / ".join(_f(v, 2) for v in c["values"]) + f"; {_f(c['mean'], 2)}")
        lines.append("| " + " | ".join(out) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", help="results.json files of `prism-select experiment select`")
    ap.add_argument("--allow", nargs="*", default=[], metavar="KEY",
                    help="dotted config keys that may differ between the files (listed in the output)")
    ap.add_argument("--out", help="write the combined results here (JSON)")
    ap.add_argument("--against", nargs="*", default=["random", "Full data"], metavar="ROW",
                    help="rows to take paired differences from (none: pass --against alone)")
    ap.add_argument("--task", default="mean",
                    help="the printed tables' column: a target task, or mean (the JSON holds every one)")
    args = ap.parse_args(argv)
    res = combine_seeds(read_results(args.results), allow=tuple(args.allow))
    res["sources"] = [str(p) for p in args.results]
    res["paired_differences"] = {a: paired(res, a) for a in args.against}
    res["share_vs_gain"] = share_vs_gain(res)
    if args.out:
        atomic_write_json(Path(args.out), res)
    print(markdown(res, args.against, args.task))
    if any(t["name"] == "balanced_accuracy" for t in res["tables"]):
        res["paired_differences_balanced"] = {a: paired(res, a, metric="balanced_accuracy") for a in args.against}
        if args.out:
            atomic_write_json(Path(args.out), res)
        print("\nbalanced over the reference answers:")
        print(markdown(res, args.against, args.task, metric="balanced_accuracy"))
    for key, groups in res["config_differences"].items():
        print(f"config {key}: " + "; ".join(f"{g['value']} (seeds {g['seeds']})" for g in groups))
    if res["share_vs_gain"] and res["share_vs_gain"]["pearson_r"] is not None:
        c = res["share_vs_gain"]
        print(f"target-task share vs accuracy minus {c['against']}: Pearson r {c['pearson_r']:.2f} "
              f"over {c['n']} (method, seed) pairs")
    return 0


if __name__ == "__main__":
    run_script(main)
