"""Rankings of a repair or ranking experiment's scored methods, read from its run folders: AUROC of
the pool's ``harmful`` flag and recall of the harmful records in the top k% per method,
target set and seed, with the mean and standard deviation over seeds and the ``pi``
summary of each run (in the table: its range over the seeds and the mean of the seeds'
means). It needs only the scoring steps to have finished (no retraining), so it reads an
experiment cut short before its retrainings as well as a finished one.

    python experiments/rankings_of_runs.py RUN_DIR [--json OUT.json] [--fractions 0.05,0.1,0.2] [--floors]

``--floors`` adds the floors of each pool and target set as rows ``floor: NAME`` (AUROC
only): the keyword, length and TF-IDF neighbour rules (:mod:`prism_select.evaluation.floors`)
and, with ``--family dropped_carry``, that family's knowledge floors (the arithmetic checker,
"the prompt is a carry problem").

A scores file's extra columns (IF-Guide's ``token_sum``, its document sums) rank as rows
``METHOD:COLUMN``.

``--add`` joins the rows of earlier ``--json`` files (runs of the same config in other
folders); ``--add-methods judge less`` keeps only those methods' rows of them.

``--paired prism`` adds, per setting and target set, that method minus every other row
(methods, columns and floors) over the seeds both have: the mean with a 95% t interval for
the AUROC and each recall (``paired`` in the JSON).

RUN_DIR is an experiment's ``--out`` folder (``runs/<setting>/seed<k>/<targets>/scores/<method>/``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prism_select.evaluation.experiment import (FLOOR_TITLES, mean_std, paired_interval, row_title,  # noqa: E402
                                                score_columns)
from prism_select.evaluation_metrics import auroc, labels_by_id  # noqa: E402
from prism_select.selection import read_scores  # noqa: E402


def rankings(run_dir: Path, fractions: list, label: str = "harmful", scored_model: str = "the scored model") -> list:
    rows = []
    for seed_dir in sorted(run_dir.glob("runs/*/seed*")):
        labels = labels_by_id(seed_dir / "pool.jsonl", label)
        n_harm = sum(labels.values())
        for method_dir in sorted(seed_dir.glob("*/scores/*")):
            if not (method_dir / "scores.jsonl").exists():
                continue
            scores = read_scores(method_dir / "scores.jsonl")
            run = json.loads((method_dir / "run.json").read_text()) if (method_dir / "run.json").exists() else {}
            # a method's extra columns (IF-Guide's token_sum) rank as rows "method:column"
            for column in ["score", *score_columns(scores)]:
                order = sorted(scores, key=lambda r: (-r[column], r["rank"]))
                row = {"setting": seed_dir.parent.name, "seed": int(seed_dir.name[4:]),
                       "targets": method_dir.parent.parent.name,
                       "method": method_dir.name if column == "score" else f"{method_dir.name}:{column}",
                       "auroc": auroc([r[column] for r in scores], [labels[r["id"]] for r in scores])}
                for f in fractions:
                    top = order[:round(f * len(order))]
                    row[f"recall@{f:g}"] = sum(labels[r["id"]] for r in top) / n_harm if n_harm else float("nan")
                row["pi"] = run.get("pi")
                title = row_title(method_dir.name, run, scored_model) if column == "score" else None
                if title:
                    row["title"] = title
                rows.append(row)
    return rows


def floor_rows(run_dir: Path, label: str = "harmful", family: str | None = None) -> list:
    """One row per floor, pool and target set (``floor: NAME``, its AUROC)."""
    from prism_select.evaluation.experiment import read_jsonl
    from prism_select.evaluation.floors import floors
    from prism_select.evaluation.repair import family_floors
    extra = family_floors() if family == "dropped_carry" else None
    rows = []
    for seed_dir in sorted(run_dir.glob("runs/*/seed*")):
        pool = read_jsonl(seed_dir / "pool.jsonl")
        for targets in sorted(seed_dir.glob("*/targets.jsonl")):
            for name, f in floors(pool, read_jsonl(targets), label, extra).items():
                rows.append({"setting": seed_dir.parent.name, "seed": int(seed_dir.name[4:]),
                             "targets": targets.parent.name, "method": f"floor: {name}", "auroc": f["auroc"],
                             "rule": f["rule"], **({"title": FLOOR_TITLES[name]} if name in FLOOR_TITLES else {})})
    return rows


def summary(rows: list, fractions: list) -> list:
    keys = ["auroc"] + [f"recall@{f:g}" for f in fractions]
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["setting"], r["targets"], r["method"]), []).append(r)
    out = []
    for (setting, targets, method), rs in sorted(groups.items()):
        s = {"setting": setting, "targets": targets, "method": method, "seeds": sorted(r["seed"] for r in rs)}
        for k in keys:
            ms = mean_std([r[k] for r in rs if k in r])
            s[k], s[k + "_std"] = ms["mean"], ms["std"] or 0.0
        s["title"] = next((r["title"] for r in rs if r.get("title")), None)
        pis = [r["pi"] for r in rs if isinstance(r.get("pi"), dict)]
        s["pi"] = ({"min": min(p["min"] for p in pis), "mean": sum(p["mean"] for p in pis) / len(pis),
                    "max": max(p["max"] for p in pis)} if pis else None)
        out.append(s)
    return out


def paired(rows: list, fractions: list, method: str) -> list:
    """``method`` minus every other row of its (setting, targets), paired by seed: for the
    AUROC and each recall, the mean difference with its 95% t interval over the shared seeds."""
    keys = ["auroc"] + [f"recall@{f:g}" for f in fractions]
    by: dict = {}
    for r in rows:
        by.setdefault((r["setting"], r["targets"]), {}).setdefault(r["method"], {})[r["seed"]] = r
    out = []
    for (setting, targets), methods in sorted(by.items()):
        base = methods.get(method)
        if base is None:
            continue
        for other, runs in sorted(methods.items()):
            seeds = sorted(set(base) & set(runs))
            if other == method or not seeds:
                continue
            row = {"setting": setting, "targets": targets, "minus": other, "seeds": seeds}
            for k in keys:
                diffs = [base[s][k] - runs[s][k] for s in seeds if base[s].get(k) is not None
                         and runs[s].get(k) is not None]
                row[k] = paired_interval(diffs) if diffs else None
            out.append(row)
    return out


def _interval_cell(d) -> str:
    if d is None:
        return ""
    ci = f" [{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}]" if d["ci"] is not None else ""
    return f"{d['mean']:+.3f}{ci}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--fractions", default="0.05,0.1,0.2")
    ap.add_argument("--label", default="harmful")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--floors", action="store_true", help="add the floors of every pool and target set")
    ap.add_argument("--family", choices=["dropped_carry"], help="with --floors: that family's knowledge floors too")
    ap.add_argument("--add", type=Path, nargs="*", default=[], metavar="JSON",
                    help="the rows of earlier --json files too (runs of the same config in other folders, e.g. "
                         "other seeds); a (setting, targets, method, seed) this folder also has is refused")
    ap.add_argument("--add-methods", nargs="+", metavar="METHOD",
                    help="with --add: only these methods' rows of the added files (a run that re-scored some "
                         "methods on the same pools also holds random's and the floors' rows)")
    ap.add_argument("--scored-model", default="the scored model",
                    help="what the scored model is, for the judge's row when it judges with it (e.g. 'the start model')")
    ap.add_argument("--paired", metavar="METHOD",
                    help="that method minus every other row, paired by seed, with 95%% t intervals")
    a = ap.parse_args(argv)
    fractions = [float(x) for x in a.fractions.split(",")]
    rows = rankings(a.run_dir, fractions, a.label, a.scored_model)
    if a.floors:
        rows += floor_rows(a.run_dir, a.label, a.family)
    key = lambda r: (r["setting"], r["targets"], r["method"], r["seed"])  # noqa: E731
    for path in a.add:
        earlier = [r for r in json.loads(path.read_text())["rows"]
                   if not a.add_methods or r["method"] in a.add_methods]
        twice = sorted({key(r) for r in earlier} & {key(r) for r in rows})
        if twice:
            print(f"{path}: rows this folder has too: {twice[:3]}", file=sys.stderr)
            return 1
        rows += earlier
    if not rows:
        print(f"no scored methods under {a.run_dir}/runs/*/seed*/", file=sys.stderr)
        return 1
    summ = summary(rows, fractions)
    cols = ["auroc"] + [f"recall@{f:g}" for f in fractions]
    print("| setting | targets | method | seeds | " + " | ".join(cols) + " | pi: min / mean / max |")
    print("|---|---|---|---|" + "---|" * len(cols) + "---|")
    for s in summ:
        cells = [f"{s[c]:.3f} ± {s[c + '_std']:.3f}" if s[c] is not None else "" for c in cols]
        pi = s["pi"]
        pi_cell = f"{pi['min']:.2f} / {pi['mean']:.2f} / {pi['max']:.2f}" if pi else "-"
        print(f"| {s['setting']} | {s['targets']} | {s['title'] or s['method']} | {','.join(map(str, s['seeds']))} | "
              + " | ".join(cells) + f" | {pi_cell} |")
    extra = {}
    if a.paired:
        extra["paired"] = diffs = paired(rows, fractions, a.paired)
        print(f"\n{a.paired} minus each row, paired by seed (mean, 95% t interval):\n")
        print("| setting | targets | minus | seeds | " + " | ".join(cols) + " |")
        print("|---|---|---|---|" + "---|" * len(cols))
        for d in diffs:
            print(f"| {d['setting']} | {d['targets']} | {d['minus']} | {','.join(map(str, d['seeds']))} | "
                  + " | ".join(_interval_cell(d[c]) for c in cols) + " |")
    if a.json:
        a.json.write_text(json.dumps({"rows": rows, "summary": summ, **extra}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
