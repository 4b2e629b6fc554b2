"""Rankings of a repair or ranking experiment's scored methods, read from its run folders: AUROC of
the pool's ``harmful`` flag and recall of the harmful records in the top k% per method,
target set and seed, with the mean and standard deviation over seeds and the ``pi``
summary of each run (in the table: its range over the seeds and the mean of the seeds'
means). It needs only the scoring steps to have finished (no retraining), so it reads an
experiment cut short before its retrainings as well as a finished one.

    prism-select experiment rows rankings RUN_DIR [--json OUT.json] [--fractions 0.05,0.1,0.2] [--floors]

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

import json
from pathlib import Path

from ...errors import InputError
from ...evaluation_metrics import auroc, labels_by_id
from ...selection import read_scores
from ..experiment import FLOOR_TITLES, mean_std, paired_interval, read_jsonl, row_title, score_columns
from ..floors import floors
from ..repair import family_floors


def rankings(run_dir: Path, fractions: list, label: str = "harmful", scored_model: str = "the scored model") -> list:
    """One row per (setting, seed, targets, method or ``METHOD:COLUMN``) with a scores file:
    its AUROC of ``label``, recall at each fraction, and the run's ``pi`` summary."""
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
    """Per (setting, targets, method): the seeds, mean and sd of each column, the ``pi`` range."""
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


def add_rows(rows: list, paths: list, methods: list | None = None) -> list:
    """``rows`` and the rows of earlier ``--json`` files (only ``methods``' where given); a
    (setting, targets, method, seed) both hold is an :class:`InputError`."""
    key = lambda r: (r["setting"], r["targets"], r["method"], r["seed"])  # noqa: E731
    rows = list(rows)
    for path in paths:
        earlier = [r for r in json.loads(Path(path).read_text())["rows"] if not methods or r["method"] in methods]
        twice = sorted({key(r) for r in earlier} & {key(r) for r in rows})
        if twice:
            raise InputError(f"{path}: rows this folder has too: {twice[:3]}")
        rows += earlier
    return rows


def summary_markdown(summ: list, fractions: list) -> str:
    """:func:`summary` as a markdown table (its title where a row has one)."""
    cols = ["auroc"] + [f"recall@{f:g}" for f in fractions]
    lines = ["| setting | targets | method | seeds | " + " | ".join(cols) + " | pi: min / mean / max |",
             "|---|---|---|---|" + "---|" * len(cols) + "---|"]
    for s in summ:
        cells = [f"{s[c]:.3f} ± {s[c + '_std']:.3f}" if s[c] is not None else "" for c in cols]
        pi = s["pi"]
        pi_cell = f"{pi['min']:.2f} / {pi['mean']:.2f} / {pi['max']:.2f}" if pi else "-"
        lines.append(f"| {s['setting']} | {s['targets']} | {s['title'] or s['method']} | "
                     f"{','.join(map(str, s['seeds']))} | " + " | ".join(cells) + f" | {pi_cell} |")
    return "\n".join(lines)


def paired_markdown(diffs: list, fractions: list, method: str) -> str:
    """:func:`paired`'s rows as a markdown table under a line naming ``method``."""
    cols = ["auroc"] + [f"recall@{f:g}" for f in fractions]
    lines = [f"\n{method} minus each row, paired by seed (mean, 95% t interval):\n",
             "| setting | targets | minus | seeds | " + " | ".join(cols) + " |", "|---|---|---|---|" + "---|" * len(cols)]
    for d in diffs:
        lines.append(f"| {d['setting']} | {d['targets']} | {d['minus']} | {','.join(map(str, d['seeds']))} | "
                     + " | ".join(_interval_cell(d[c]) for c in cols) + " |")
    return "\n".join(lines)
