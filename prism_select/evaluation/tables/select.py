"""Rows of a select experiment read from the files its steps left, finished or not.

`prism-select experiment select` writes results.json at the end; a run stopped before
(a device call's time ran out), or whose parallel jobs each wrote results.json for their
own seeds only, still holds every finished step: per seed the Start and Full-data
responses, each method's scores and selection, and each selection's responses (one per
fine-tuning seed under ``ft<seed>/`` when the config lists ``finetune_seeds``). This
script rebuilds each seed's run from those files with the protocol's own functions and
writes the protocol's tables (accuracy, balanced accuracy, selection shares, spread over
the fine-tuning seeds, paired differences with 95% t intervals), plus, where the target
task has wrong records, each ranking's AUROC of the task's right records over its wrong
ones. A row is in a seed's run only when its selection and every fine-tuning of it
finished; the tables' ``n`` says how many seeds each row has, and the paired rows pair
only the seeds both rows have.

    python experiments/select_rows_from_files.py RUN_DIR --config experiments/carry_select.yaml \
        --json rows.json --markdown rows.md
Nothing is trained or scored; adapters are not needed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from prism_select.evaluation import general_selection as gs
from prism_select.evaluation.config import load_config
from prism_select.evaluation.experiment import (majority_answer_floor, mean_std, read_jsonl, resolve_methods)
from prism_select.evaluation_metrics import auroc


def _responses(mdir: Path, ft_seeds) -> list | None:
    """The responses files of one finished row (one per fine-tuning seed), None if unfinished."""
    files = [mdir / "responses.jsonl"] if not ft_seeds else [mdir / f"ft{s}" / "responses.jsonl" for s in ft_seeds]
    return files if all(f.is_file() for f in files) else None


def _within_task_auroc(scores_path: Path, pool: dict, task: str) -> float | None:
    """AUROC of the target task's right records over its wrong (``mislabeled``) ones."""
    rows = [r for r in read_jsonl(scores_path) if pool[r["id"]].get("task") == task]
    labels = [not pool[r["id"]].get("mislabeled") for r in rows]
    if not rows or all(labels) or not any(labels):
        return None
    return auroc([r["score"] for r in rows], labels)


def seed_run(sdir: Path, cfg, methods: list, task: str | None) -> dict:
    """One seed's run dict, as :func:`general_selection._select_seed` writes it, from files."""
    ft_seeds = cfg.finetune_seeds
    run = {"setting": "select", "seed": int(sdir.name.removeprefix("seed")), "dir": str(sdir), "accuracy": {},
           "rows_finished": [], "within_task_auroc": {}}
    if (sdir / "start" / "responses.jsonl").is_file():
        gs._merge(run, "Start", sdir / "start" / "responses.jsonl")
    probes = read_jsonl(sdir / "heldout.jsonl")
    if probes and all(p.get("reference") is not None for p in probes):
        for key, values in zip(gs.METRICS, majority_answer_floor(probes)):
            gs._merge_values(run, key, gs.MAJORITY_ROW, values)
    if (sdir / "full" / "responses.jsonl").is_file():
        gs._merge(run, "Full data", sdir / "full" / "responses.jsonl")
    pool = {r["id"]: r for r in read_jsonl(sdir / "pool.jsonl")}
    rows = [gs.TASK_ROW, gs.RIGHT_ROW] + methods
    scores_dir = {gs.TASK_ROW: sdir / "floors" / "task_records", gs.RIGHT_ROW: sdir / "floors" / "task_records_right",
                  **{m: sdir / "scores" / m for m in methods}}
    for m in rows:
        mdir = sdir / "selected" / m
        files = _responses(mdir, ft_seeds)
        if files is None or not (mdir / "subset.jsonl").is_file():
            continue
        run["rows_finished"].append(m)
        chosen = read_jsonl(mdir / "subset.jsonl")
        run["n_selected"] = len(chosen)
        if task is not None:
            gs._share(run, "target_task_share", task, m, [r.get("task") == task for r in chosen])
            if cfg.multitask.mislabeled_share:
                gs._share(run, "mislabeled_share", task, m, [bool(r.get("mislabeled")) for r in chosen])
                if (scores_dir[m] / "scores.jsonl").is_file():
                    run["within_task_auroc"][m] = _within_task_auroc(scores_dir[m] / "scores.jsonl", pool, task)
        if not ft_seeds:
            gs._merge(run, m, files[0])
            continue
        gs.merge_finetunes(run, m, dict(zip(ft_seeds, files)))
    return run


def rows_from_files(run_dir: Path, cfg) -> dict:
    """results.json-like content rebuilt from ``run_dir``'s files (module docstring)."""
    methods = resolve_methods(cfg.methods)
    targets = cfg.multitask.selected_targets() if cfg.multitask is not None else None
    if targets and len(cfg.multitask.targets_of()) > 1:
        raise SystemExit("runs of several target tasks: read each task's folder with a one-task config")
    task = targets[0] if targets else None
    seed_dirs = sorted((run_dir / "runs").glob("seed*"), key=lambda p: int(p.name.removeprefix("seed")))
    runs = [r for r in (seed_run(d, cfg, methods, task) for d in seed_dirs) if r["rows_finished"]]
    if not runs:
        raise SystemExit(f"no finished selection under {run_dir / 'runs'}")
    tables = gs.select_tables(runs, methods, cfg.fraction, targets)
    if any(r["within_task_auroc"] for r in runs):
        rows = [gs.TASK_ROW, gs.RIGHT_ROW] + methods
        tables.append({"name": "within_task_auroc", "title": "AUROC of the target task's right records over its "
                       "wrong ones, by each ranking", "columns": ["auroc"], "lower_is_better": False, "note": "",
                       "rows": [{"label": m, "cells": [mean_std([r["within_task_auroc"].get(m) for r in runs])]}
                                for m in rows if any(m in r["within_task_auroc"] for r in runs)]})
    return {"protocol": "select", "source": str(run_dir), "methods": methods, "seeds": [r["seed"] for r in runs],
            "runs": runs, "tables": tables}


def markdown(res: dict) -> str:
    """Each table as markdown: mean (sd, n) cells, paired cells as mean [lo, hi] (n)."""
    out = []
    for t in res["tables"]:
        out += [f"### {t['title']}", "", "| row | " + " | ".join(t["columns"]) + " |",
                "|---|" + "---|" * len(t["columns"])]
        for row in t["rows"]:
            cells = []
            for c in row["cells"]:
                if c.get("mean") is None:
                    cells.append("-")
                elif t.get("paired"):
                    ci = c.get("ci")
                    span = f" [{ci[0]:+.3f}, {ci[1]:+.3f}]" if ci else ""
                    cells.append(f"{c['mean']:+.3f}{span} ({c['n']})")
                else:
                    sd = "" if c.get("std") is None else f" ± {c['std']:.3f}"
                    cells.append(f"{c['mean']:.3f}{sd} ({c['n']})")
            out.append(f"| {row['label']} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path, help="the select experiment's --out folder")
    ap.add_argument("--config", required=True, help="the experiment's config (its methods, fraction, finetune_seeds)")
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    a = ap.parse_args()
    res = rows_from_files(a.run_dir, load_config(a.config, "select", data_root="."))
    text = markdown(res)
    print(text)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    if a.markdown:
        Path(a.markdown).write_text(text)


if __name__ == "__main__":
    main()
