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

    prism-select experiment rows select RUN_DIR --config experiments/carry_select.yaml \
        --json rows.json --markdown rows.md

:func:`selection_rows` (``experiment rows shares RUN_DIR...``) tables, before any
fine-tuning, what each method's top fraction holds: per seed, target task and method with
a ``scores.jsonl``, the share of the selection from the target task and the share that
answers wrong (``mislabeled`` pool records), whether the task's right records rank above
its wrong ones, whether its records giving the task's most common answer rank above those
giving the second (``by_answer``) and which answers the selection holds, the split-half
check's choice, the method's recorded step times and, once the selection is fine-tuned,
what the model answers the held-out probes (``heldout``: accuracy and the first words of
its responses). RUN_DIR: an experiment folder (``runs/seed<k>/<task>/scores/<method>/``,
or ``runs/seed<k>/scores/<method>/`` for a run of one target task); a seed, task and
method found in several folders is read from the first.

Nothing is trained or scored; adapters are not needed.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from pathlib import Path

from ...errors import InputError
from ...evaluation_metrics import auroc
from .. import general_selection as gs
from ..experiment import majority_answer_floor, mean_std, read_jsonl, resolve_methods


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
        gs.merge_responses(run, "Start", sdir / "start" / "responses.jsonl")
    probes = read_jsonl(sdir / "heldout.jsonl")
    if probes and all(p.get("reference") is not None for p in probes):
        for key, values in zip(gs.METRICS, majority_answer_floor(probes)):
            gs.merge_values(run, key, gs.MAJORITY_ROW, values)
    if (sdir / "full" / "responses.jsonl").is_file():
        gs.merge_responses(run, "Full data", sdir / "full" / "responses.jsonl")
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
            gs.add_share(run, "target_task_share", task, m, [r.get("task") == task for r in chosen])
            if cfg.multitask.mislabeled_share:
                gs.add_share(run, "mislabeled_share", task, m, [bool(r.get("mislabeled")) for r in chosen])
                if (scores_dir[m] / "scores.jsonl").is_file():
                    run["within_task_auroc"][m] = _within_task_auroc(scores_dir[m] / "scores.jsonl", pool, task)
        if not ft_seeds:
            gs.merge_responses(run, m, files[0])
            continue
        gs.merge_finetunes(run, m, dict(zip(ft_seeds, files)))
    return run


def rows_from_files(run_dir: Path, cfg) -> dict:
    """results.json-like content rebuilt from ``run_dir``'s files (module docstring)."""
    methods = resolve_methods(cfg.methods)
    targets = cfg.multitask.selected_targets() if cfg.multitask is not None else None
    if targets and len(cfg.multitask.targets_of()) > 1:
        raise InputError("runs of several target tasks: read each task's folder with a one-task config")
    task = targets[0] if targets else None
    seed_dirs = sorted((run_dir / "runs").glob("seed*"), key=lambda p: int(p.name.removeprefix("seed")))
    runs = [r for r in (seed_run(d, cfg, methods, task) for d in seed_dirs) if r["rows_finished"]]
    if not runs:
        raise InputError(f"no finished selection under {run_dir / 'runs'}")
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


def _wrong_among(records: list, task: str) -> float | None:
    """The share of ``records`` of ``task`` that answer wrong (None without any)."""
    of_task = [r for r in records if r.get("task") == task]
    return sum(bool(r.get("mislabeled")) for r in of_task) / len(of_task) if of_task else None


def _by_answer(pool: dict, score: dict, task: str) -> dict | None:
    """AUROC of the task's records giving its most common answer over those giving the
    second (responses compared stripped and lower-cased), or None with fewer than two."""
    by: dict = {}
    for i, r in pool.items():
        if r.get("task") == task:
            by.setdefault(str(r.get("response", "")).strip().lower(), []).append(score[i])
    top = sorted(by, key=lambda k: -len(by[k]))[:2]
    if len(top) < 2:
        return None
    first, second = by[top[0]], by[top[1]]
    return {"answer": top[0], "over": top[1], "auroc": auroc(first + second, [True] * len(first) + [False] * len(second))}


def _first_word(text: str) -> str:
    """A response's first word, lower-cased, without trailing punctuation."""
    words = str(text).strip().split()
    return words[0].strip(".,:;!").lower() if words else ""


def heldout_answers(mdir: Path) -> dict | None:
    """A selection's fine-tuned models' held-out responses (``responses.jsonl``, or one per
    fine-tuning seed under ``ft<seed>/``, pooled): their accuracy and how often each first
    word opens a response (None before any fine-tuning finished)."""
    files = ([mdir / "responses.jsonl"] if (mdir / "responses.jsonl").is_file()
             else sorted(mdir.glob("ft*/responses.jsonl")))
    if not files:
        return None
    rows = [r for f in files for r in read_jsonl(f)]
    return {"accuracy": sum(bool(r.get("correct")) for r in rows) / len(rows) if rows else None,
            "first_words": dict(Counter(_first_word(r.get("response", "")) for r in rows).most_common())}


def _score_dirs(sdir: Path) -> list:
    """A seed's method folders: ``<task>/scores/<method>`` per target task, or
    ``scores/<method>`` where the run selected for one task (its seed folder holds it)."""
    return sorted(sdir.glob("scores/*")) if (sdir / "scores").is_dir() else sorted(sdir.glob("*/scores/*"))


def selection_rows(run_dirs: list, fraction: float) -> list:
    """One row per (seed, target task, method) with a scores file (module docstring)."""
    rows, seen = [], set()
    for d in run_dirs:
        for sdir in sorted(Path(d).glob("runs/seed*")):
            pool = {r["id"]: r for r in read_jsonl(sdir / "pool.jsonl")}
            k = round(fraction * len(pool))
            for mdir in _score_dirs(sdir):
                tdir, method = mdir.parent.parent, mdir.name
                task = tdir.name if tdir != sdir else read_jsonl(sdir / "targets.jsonl")[0]["task"]
                key = (int(sdir.name[4:]), task, method)
                if key in seen or not (mdir / "scores.jsonl").is_file():
                    continue
                seen.add(key)
                ranked = sorted(read_jsonl(mdir / "scores.jsonl"), key=lambda r: r["rank"])
                score = {r["id"]: r["score"] for r in ranked}
                right = [score[i] for i, r in pool.items() if r.get("task") == task and not r.get("mislabeled")]
                wrong = [score[i] for i, r in pool.items() if r.get("task") == task and r.get("mislabeled")]
                top = [pool[r["id"]] for r in ranked[:k]]
                run = json.loads((mdir / "run.json").read_text()) if (mdir / "run.json").is_file() else {}
                check = (run.get("curvature") or {}).get("split_half")
                rows.append({"seed": key[0], "task": task, "method": method, "pool": len(pool), "selected": k,
                             "target_task_share": sum(r.get("task") == task for r in top) / k,
                             "mislabeled_share": sum(bool(r.get("mislabeled")) for r in top) / k,
                             "wrong_among_target_task": _wrong_among(top, task),
                             # does the method rank the task's right records above its wrong ones?
                             "auroc_right_over_wrong": (auroc(right + wrong, [True] * len(right) + [False] * len(wrong))
                                                        if right and wrong else None),
                             # or by which answer they give?
                             "by_answer": _by_answer(pool, score, task),
                             "answers_selected": dict(Counter(str(r.get("response", "")).strip().lower()
                                                              for r in top if r.get("task") == task)),
                             "pool_wrong_among_target_task": _wrong_among(list(pool.values()), task),
                             "split_half": check,
                             # what the model fine-tuned on the selection answers the task's held-out probes
                             "heldout": heldout_answers(tdir / "selected" / method),
                             "timings_s": {n: round(v, 1) for n, v in (run.get("timings") or {}).items()
                                           if isinstance(v, (int, float))}})
    return sorted(rows, key=lambda r: (r["seed"], r["task"], r["method"]))


def selection_markdown(rows: list) -> str:
    """The means of :func:`selection_rows` over the (seed, task) pairs, per method."""
    pool_wrong = statistics.mean(r["pool_wrong_among_target_task"] for r in rows)
    lines = [f"the pool's target-task records answering wrong: {pool_wrong:.2f} (mean over the (seed, task) pairs)",
             "| method | (seed, task) pairs | share of the target task | share answering wrong | "
             "wrong among its target-task records | AUROC, the task's right over its wrong records |",
             "|---|---|---|---|---|---|"]
    for m in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == m]
        share = statistics.mean(r["target_task_share"] for r in mine)
        wrong = statistics.mean(r["mislabeled_share"] for r in mine)
        cond = [r["wrong_among_target_task"] for r in mine if r["wrong_among_target_task"] is not None]
        au = [r["auroc_right_over_wrong"] for r in mine if r["auroc_right_over_wrong"] is not None]
        cells = [f"{statistics.mean(v):.2f}" + (f" ({min(v):.2f}-{max(v):.2f})" if len(v) > 1 else "") if v else "-"
                 for v in (cond, au)]
        lines.append(f"| {m} | {len(mine)} | {share:.2f} | {wrong:.2f} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)
