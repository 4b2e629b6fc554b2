"""The general-selection protocol (the paper's App. E): the top ``fraction`` (5%) of a
pool by each method (and ``random``) for per-task target pairs -> LoRA SFT
(``general`` preset) -> accuracy on each task's held-out probes; rows ``Start`` and
``Full data``. The experiment directory: :mod:`.experiment`.
"""

from __future__ import annotations

import copy
import json
import os
import random
import zlib
from pathlib import Path

from ..errors import InputError
from ..selection import choose, read_scores, write_subset
from . import carry
from .builders.bbh import bbh_splits, task_probes
from .builders.multitask import multitask_pool, other_answer_targets, targets_from_responses
from .config import config_to_dict
from .sections import SelectConfig
from .experiment import (Experiment, accuracy_by_task, balanced_accuracy_by_task, finetuned_responses,
                         finish_experiment, load_start, majority_answer_floor, mean_std, paired_interval, pct,
                         read_jsonl, resolve_methods, respond, score_methods, write_if_changed)

#: the row of the floor a model reaches by giving every held-out probe its task's most
#: common reference answer (:func:`.experiment.majority_answer_floor`)
MAJORITY_ROW = "Majority answer"
#: the row of the floor a selector reaches with the records' task labels alone: the budget
#: filled with the target task's records in a seeded random order (:func:`_task_floor_scores`)
TASK_ROW = "Task records"
#: the row of a perfect selector within the task: the budget filled with the target task's
#: right records (not ``mislabeled``) in the same seeded order, where the pool has wrong ones;
#: how far it stands above ``Task records`` is what picking right records can gain
RIGHT_ROW = "Task records, right only"
#: the rows every other row is compared with, paired by seed (row -> table name part)
COMPARATORS = {"random": "random", "less": "less", TASK_ROW: "task_records", RIGHT_ROW: "right_only"}
#: the carry target task's candidate problems per target pair wanted (then the held-out
#: probes; fewer where the family has fewer left): a warmed-up start model answers about
#: one carry problem in 14 wrong, and must answer ``n_targets`` wrong among them
CARRY_CANDIDATES_PER_TARGET = 24
#: the accuracy metrics of a select run: plain, and balanced over each task's reference
#: answers (:func:`.experiment.balanced_accuracy_by_task`), which a model that answers
#: every probe alike cannot raise above 1/k
METRICS = {"accuracy": "Held-out accuracy", "balanced_accuracy": "Held-out accuracy balanced over the reference answers"}


def select(config: SelectConfig, out_dir, *, overwrite: bool = False) -> dict:
    """The general-selection protocol (module docstring); returns results.json's content."""
    cfg = config
    exp = Experiment(out_dir, "select", cfg, overwrite)
    methods = resolve_methods(cfg.methods)
    pool_path = Path(cfg.pool) if cfg.multitask is None else None
    if pool_path is not None and not pool_path.exists():
        raise InputError("pool file not found", path=pool_path, fix="set 'pool' in the config")
    lm = load_start(exp, cfg)
    runs = []
    for seed in cfg.seeds:
        sdir = exp.out / "runs" / f"seed{seed}"
        sdir.mkdir(parents=True, exist_ok=True)
        pool_path, splits = _seed_data(exp, lm, seed, sdir, pool_path)
        runs.append(_select_seed(exp, lm, seed, sdir, pool_path, splits, methods))
    target_tasks = cfg.multitask.selected_targets() if cfg.multitask is not None else None
    tables = select_tables(runs, methods, cfg.fraction, target_tasks)
    results = {"protocol": "select", "config": config_to_dict(cfg), "methods": methods,
               "settings": tables[0]["columns"], "seeds": cfg.seeds, "runs": runs, "tables": tables,
               "model": {"fingerprint": lm.fingerprint, **{k: v for k, v in lm.source.items() if k != "versions"}}}
    return finish_experiment(exp, results)


def _seed_data(exp, lm, seed: int, sdir: Path, pool_path: Path | None) -> tuple:
    """``(pool_path, splits)`` of one seed; ``splits``: ``(task, dir, targets_path,
    heldout_path)`` per selection (one per target task of a multitask build, one with
    task None otherwise), each written under ``sdir``."""
    cfg = exp.cfg
    if cfg.multitask is not None:
        mt = cfg.multitask
        tasks = mt.targets_of()
        pool, rest = multitask_pool(mt.gsm8k_train, mt.bbh_dir, mt.tasks, tasks, n_gsm8k=mt.n_gsm8k,
                                    n_per_task=mt.n_per_task, seed=seed,
                                    n_per_target_task=mt.n_per_target_task,
                                    mislabeled_share=mt.mislabeled_share, n_no_carry=mt.n_no_carry,
                                    n_carry_candidates=CARRY_CANDIDATES_PER_TARGET * mt.n_targets
                                    + mt.n_heldout,
                                    n_warmup=cfg.warmup.n_records if cfg.warmup else 0,
                                    warmup_carry_share=cfg.warmup.carry_share if cfg.warmup else 0.5)
        pool_path = sdir / "pool.jsonl"
        write_if_changed(pool_path, pool)
        splits = []
        for task in mt.selected_targets():
            tdir = sdir if len(tasks) == 1 else sdir / task
            tdir.mkdir(parents=True, exist_ok=True)
            if mt.rejected == "start_model":
                targets, heldout = _start_model_targets(exp, lm, task, rest[task], tdir)
            elif task == carry.SELECT_TASK:
                targets, heldout = carry.counterfactual_split(rest[task], mt.n_targets, mt.n_heldout)
            else:
                targets, heldout = other_answer_targets(mt.bbh_dir, task, rest[task], mt.n_targets,
                                                        mt.n_heldout, seed)
            write_if_changed(tdir / "targets.jsonl", targets)
            write_if_changed(tdir / "heldout.jsonl", heldout)
            splits.append((task, tdir, tdir / "targets.jsonl", tdir / "heldout.jsonl"))
        return pool_path, splits
    if cfg.bbh is not None:
        targets, heldout = bbh_splits(cfg.bbh.dir, cfg.bbh.n_targets_per_task, seed,
                                      tasks=cfg.bbh.tasks, n_heldout_per_task=cfg.bbh.n_heldout_per_task)
        write_if_changed(sdir / "targets.jsonl", targets)
        write_if_changed(sdir / "heldout.jsonl", heldout)
        return pool_path, [(None, sdir, sdir / "targets.jsonl", sdir / "heldout.jsonl")]
    return pool_path, [(None, sdir, Path(cfg.targets), Path(cfg.heldout))]


def _start_model_targets(exp, lm, task: str, left: list, tdir: Path) -> tuple:
    """Target pairs whose ``rejected`` is the start model's own wrong response: its
    judged greedy responses to the task's examples outside the pool
    (``candidates/responses.jsonl``), then :func:`.targets_from_responses`."""
    mt = exp.cfg.multitask
    cdir = tdir / "candidates"
    cdir.mkdir(parents=True, exist_ok=True)
    # the arithmetic task's candidates are probe records already; a BBH task's, example indices
    candidates = left if task == carry.SELECT_TASK else task_probes(mt.bbh_dir, task, left)
    write_if_changed(cdir / "probes.jsonl", candidates)
    resp = respond(exp, lm, cdir / "probes.jsonl", cdir, exp.cfg.checker, f"candidates:{task}")
    return targets_from_responses(candidates, read_jsonl(resp), mt.n_targets, mt.n_heldout)


def _select_seed(exp, lm, seed: int, sdir: Path, pool_path: Path, splits: list, methods: list) -> dict:
    """One seed: per split, every method's scores, its top ``fraction`` fine-tuned and
    judged on the split's held-out probes; rows Start and Full data (one SFT on the
    pool, judged on every split)."""
    cfg = exp.cfg
    # one selection: the seed's folder holds it, as before target tasks (a run that selects
    # for some of several target tasks keeps the several-task layout)
    one = cfg.multitask is None or len(cfg.multitask.targets_of()) == 1
    rel = lambda p: os.path.relpath(p, exp.out)  # noqa: E731
    run = {"setting": "select", "seed": seed, "dir": exp.rel(sdir), "pool": rel(pool_path),
           "targets": rel(splits[0][2]), "heldout": rel(splits[0][3]), "label": None, "accuracy": {},
           "n_selected": None}
    if not one:
        run["tasks"] = {task: {"dir": exp.rel(tdir), "targets": rel(tp), "heldout": rel(hp)}
                        for task, tdir, tp, hp in splits}
    for task, tdir, targets_path, heldout_path in splits:
        scored = score_methods(exp, lm, pool_path, targets_path, tdir, methods, seed, label=None)
        if one:
            run["methods"] = scored
        else:
            run.setdefault("methods_by_task", {})[task] = scored
        sub = "" if one else f"/{task}"
        if cfg.start_row:
            merge_responses(run, "Start", respond(exp, lm, heldout_path, tdir / "start", cfg.checker, "start" + sub))
        probes = read_jsonl(heldout_path)
        if probes and all(p.get("reference") is not None for p in probes):
            for key, values in zip(METRICS, majority_answer_floor(probes)):
                merge_values(run, key, MAJORITY_ROW, values)
        if cfg.full_data:
            fdir = sdir / "full" if one else sdir / "full" / task
            merge_responses(run, "Full data", finetuned_responses(exp, lm, pool_path, sdir / "full", heldout_path, fdir,
                                                         seed, "full" + sub))
        if task is not None and cfg.task_floor:
            records = read_jsonl(pool_path)
            floor = _task_floor_scores(records, task, seed, tdir / "floors" / "task_records")
            _select_method(exp, lm, run, TASK_ROW, {"dir": exp.rel(floor)}, task, tdir, pool_path, heldout_path,
                           seed)
            if cfg.multitask.mislabeled_share:
                right = _task_floor_scores(records, task, seed, tdir / "floors" / "task_records_right",
                                           right_only=True)
                _select_method(exp, lm, run, RIGHT_ROW, {"dir": exp.rel(right)}, task, tdir, pool_path,
                               heldout_path, seed)
        for m in methods:
            if scored[m].get("status") == "ok":
                _select_method(exp, lm, run, m, scored[m], task, tdir, pool_path, heldout_path, seed)
    if not one:
        run["methods"] = _methods_of_tasks(run["methods_by_task"])
    return run


def _task_floor_scores(records: list, task: str, seed: int, out: Path, *, right_only: bool = False) -> Path:
    """``out/scores.jsonl`` ranking ``task``'s pool ``records`` first, then the others, each
    group in an order seeded by ``seed`` and the task's name; returns ``out``. With
    ``right_only`` the task's right records (not ``mislabeled``) come first, in the same
    order, then its wrong ones (:data:`RIGHT_ROW`)."""
    rng = random.Random(seed * 1_000_003 + zlib.crc32(task.encode()))
    mine = [r["id"] for r in records if r.get("task") == task]
    rest = [r["id"] for r in records if r.get("task") != task]
    rng.shuffle(mine)
    rng.shuffle(rest)
    if right_only:
        wrong = {r["id"] for r in records if r.get("task") == task and r.get("mislabeled")}
        mine = [i for i in mine if i not in wrong] + [i for i in mine if i in wrong]
    n = len(records)
    rows = [{"id": rid, "score": float(n - i), "rank": i + 1} for i, rid in enumerate(mine + rest)]
    out.mkdir(parents=True, exist_ok=True)
    write_if_changed(out / "scores.jsonl", rows)
    return out


def _methods_of_tasks(by_task: dict) -> dict:
    """A several-task run's ``methods``: per method its first task's records (the report's
    plots), or the record of a task where it failed."""
    tasks = list(by_task)
    return {m: next((by_task[t][m] for t in tasks if by_task[t][m].get("status") != "ok"), by_task[tasks[0]][m])
            for m in by_task[tasks[0]]}


def merge_responses(run: dict, row: str, responses: Path):
    """Add one split's per-task accuracies (plain and balanced) to ``row``."""
    merge_values(run, "accuracy", row, accuracy_by_task(responses))
    balanced = balanced_accuracy_by_task(responses)
    if balanced:
        merge_values(run, "balanced_accuracy", row, balanced)


def merge_values(run: dict, key: str, row: str, values: dict):
    """``run[key][row]`` updated with one split's per-task ``values``; ``mean`` is over
    every task so far."""
    cur = {k: v for k, v in run.setdefault(key, {}).get(row, {}).items() if k != "mean"}
    cur.update({k: v for k, v in values.items() if k != "mean"})
    cur["mean"] = sum(cur.values()) / len(cur)
    run[key][row] = cur


def add_share(run: dict, name: str, task: str, m: str, flags: list):
    """``run[name][m]``: the share of true ``flags`` (one per selected record); with
    several target tasks the mean over the tasks so far, each task's in
    ``run[name + "_by_task"]``."""
    _set_share(run, name, task, m, sum(flags) / len(flags) if flags else None)


def _set_share(run: dict, name: str, task: str, m: str, value: float | None):
    """``run[name][m] = value``, or with several target tasks ``value`` as ``task``'s in
    ``run[name + "_by_task"]`` and their mean so far (None while a task has none)."""
    if "tasks" in run:
        run.setdefault(f"{name}_by_task", {}).setdefault(task, {})[m] = value
        values = [v.get(m) for v in run[f"{name}_by_task"].values()]
        value = sum(values) / len(values) if None not in values else None
    run.setdefault(name, {})[m] = value


def _select_method(exp, lm, run: dict, m: str, scored: dict, task, tdir: Path, pool_path: Path,
                   heldout_path: Path, seed: int):
    """Method ``m``'s top ``fraction`` of the pool for one split, fine-tuned and judged."""
    cfg = exp.cfg
    mdir = tdir / "selected" / m
    mdir.mkdir(parents=True, exist_ok=True)
    scores = read_scores(exp.out / scored["dir"] / "scores.jsonl")
    kept = choose(scores, keep=("fraction", cfg.fraction))
    ext = pool_path.suffix if pool_path.is_file() else ""
    subset = mdir / f"subset{ext or '.jsonl'}"
    run["n_selected"] = write_subset(pool_path, kept, subset)
    if task is not None:
        chosen = read_jsonl(subset)
        add_share(run, "target_task_share", task, m, [r.get("task") == task for r in chosen])
        if cfg.multitask.mislabeled_share:
            add_share(run, "mislabeled_share", task, m, [bool(r.get("mislabeled")) for r in chosen])
    tag = f"select:{m}" + ("" if task is None else f"/{task}")
    if not cfg.finetune_seeds:
        merge_responses(run, m, finetuned_responses(exp, lm, subset, mdir, heldout_path, mdir, seed, tag))
        return
    # one SFT per fine-tuning seed, each in ft<seed>/
    responses = {}
    for s in cfg.finetune_seeds:
        fdir = mdir / f"ft{s}"
        responses[s] = finetuned_responses(exp, lm, subset, fdir, heldout_path, fdir, s, f"{tag}/ft{s}")
    merge_finetunes(run, m, responses)


def merge_finetunes(run: dict, row: str, responses: dict):
    """Add ``row``'s fine-tunings (fine-tuning seed -> judged responses file) to ``run``:
    each under ``run["by_finetune_seed"][seed]``, and per task their mean as the row."""
    each = []
    for s, resp in responses.items():
        merge_responses(run.setdefault("by_finetune_seed", {}).setdefault(str(s), {}), row, resp)
        each.append((accuracy_by_task(resp), balanced_accuracy_by_task(resp)))
    for i, key in enumerate(METRICS):
        if all(e[i] for e in each):
            merge_values(run, key, row, {t: sum(e[i][t] for e in each) / len(each) for t in each[0][i]
                                          if t != "mean"})


def select_tables(runs: list, methods: list, fraction: float, target_tasks: list | None = None) -> list:
    """results.json's tables from the runs (seeds) of a select experiment: held-out
    accuracy per row and task; with ``target_tasks`` (a multitask pool) the share of each
    method's selection from its target task; and each row's accuracy minus random's,
    LESS's and the task-records floors' (:data:`COMPARATORS`), paired by seed with a 95% t
    interval. Cells are :func:`.mean_std` over the runs."""
    tasks = list(dict.fromkeys(t for r in runs for acc in r["accuracy"].values() for t in acc if t != "mean"))
    columns = tasks + ["mean"]
    row_keys = list(dict.fromkeys(k for r in runs for k in r["accuracy"]))
    first = ("Start", MAJORITY_ROW, "Full data", TASK_ROW, RIGHT_ROW)
    ordered = [k for k in first if k in row_keys] + [k for k in row_keys if k not in first]
    metrics = [m for m in METRICS if any(r.get(m) for r in runs)]

    def value(metric):
        return lambda run, m, task: ((run.get(metric) or {}).get(m) or {}).get(task)

    tables = [{"name": metric, "title": f"{METRICS[metric]} after fine-tuning on the top {pct(fraction)}% "
               "(higher is better)", "columns": columns, "lower_is_better": False,
               "note": "Start: no fine-tuning; Full data: fine-tuned on the whole pool"
                       + (f"; {MAJORITY_ROW}: every probe answered with its task's most common reference"
                          if MAJORITY_ROW in row_keys else ""),
               "rows": [{"label": k, "cells": [mean_std([value(metric)(r, k, c) for r in runs]) for c in columns]}
                        for k in ordered]} for metric in metrics]
    floors = [k for k in (TASK_ROW, RIGHT_ROW) if any(k in (r.get("target_task_share") or {}) for r in runs)]
    methods = floors + [m for m in methods if m not in floors]
    if target_tasks:
        tables.append(_share_table(
            runs, methods, "target_task_share", f"Share of the selected records from the target task "
            f"({', '.join(target_tasks)}; its share of the pool is the random row's expectation)", False,
            "mean over the target tasks" if len(target_tasks) > 1 else ""))
    if any(r.get("mislabeled_share") for r in runs):
        tables.append(_share_table(runs, methods, "mislabeled_share", "Share of the selected records that answer "
                                   "wrong (mislabeled target-task records; lower is better)", True))
    spread = _finetune_spread_table(runs, ordered, columns)
    if spread is not None:
        tables.append(spread)
    for metric in metrics:
        acc = value(metric)
        suffix = "" if metric == "accuracy" else "_balanced"
        what = "Accuracy" if metric == "accuracy" else "Balanced accuracy"
        for comp, slug in COMPARATORS.items():
            if comp in row_keys and len(runs) > 1:
                tables.append({"name": f"paired_vs_{slug}{suffix}", "title": f"{what} minus {comp}'s, paired by "
                               "seed (mean and 95% t interval over the seeds)", "columns": columns,
                               "lower_is_better": False, "paired": True, "note": "",
                               "rows": [{"label": k, "cells": [paired_interval(
                                   [acc(r, k, c) - acc(r, comp, c) for r in runs
                                    if acc(r, k, c) is not None and acc(r, comp, c) is not None]) for c in columns]}
                                        for k in ordered if k != comp]})
    return tables


def _finetune_spread_table(runs: list, rows: list, columns: list) -> dict | None:
    """Where the selections were fine-tuned under several seeds (``finetune_seeds``): per row
    and task, the range (max - min) of held-out accuracy over the fine-tuning seeds of one
    selection, :func:`.mean_std` over the data seeds: the noise one SFT adds to a row."""
    if not any(r.get("by_finetune_seed") for r in runs):
        return None

    def spread(run, row, task):
        vals = [((by.get("accuracy") or {}).get(row) or {}).get(task)
                for by in (run.get("by_finetune_seed") or {}).values()]
        vals = [v for v in vals if v is not None]
        return max(vals) - min(vals) if len(vals) > 1 else None

    return {"name": "finetune_spread", "title": "Held-out accuracy's range over the fine-tuning seeds of one "
            "selection (max - min; mean over the data seeds)", "columns": columns, "lower_is_better": True,
            "note": "rows without several fine-tunings (Start, Full data, Majority answer) are empty",
            "rows": [{"label": k, "cells": [mean_std([spread(r, k, c) for r in runs]) for c in columns]}
                     for k in rows]}


def _share_table(runs: list, methods: list, name: str, title: str, lower_is_better: bool, note: str = "") -> dict:
    """A one-column table of ``run[name][method]`` shares, :func:`.mean_std` over the runs."""
    return {"name": name, "title": title, "columns": ["share"], "lower_is_better": lower_is_better, "note": note,
            "rows": [{"label": m, "cells": [mean_std([(r.get(name) or {}).get(m) for r in runs])]}
                     for m in methods]}


# what may differ between the results.json files of one experiment's seeds
_PER_SEED_CONFIG = ("seeds", "data_root", "multitask.gsm8k_train", "multitask.bbh_dir", "report",
                    "multitask.select_for")


def read_results(paths: list) -> list:
    """The contents of results.json files of select experiments (an :class:`InputError`
    naming the file that cannot be read)."""
    out = []
    for p in paths:
        try:
            out.append(json.loads(Path(p).read_text(encoding="utf-8")))
        except (OSError, ValueError) as e:
            raise InputError(f"cannot read results: {e}", path=p, fix="pass results.json files") from e
    return out


def combine_seeds(results: list, *, allow: tuple = ()) -> dict:
    """One select experiment's results from the results.json contents of runs with
    other seeds (each run on its own, e.g. one device call per seed): the runs merged in
    seed order and the tables recomputed over all of them, as ``experiment select
    --seeds ...`` writes them for one output folder. Runs of one seed that selected for
    different target tasks of a multitask pool (``--target-tasks``) become that seed's
    one run (:func:`merge_task_runs`). Every number comes from the runs' recorded
    accuracies and shares; scores and responses are not needed.

    The configs must agree except in the seeds and data paths; dotted keys in ``allow``
    (e.g. ``"finetune.max_length"``) may differ too, and each difference is listed
    under ``config_differences`` with the seeds of each value."""
    if not results:
        raise InputError("no results to combine")
    if any(r.get("protocol") != "select" for r in results):
        raise InputError("combine_seeds takes results of the select protocol only",
                         fix="pass results.json files of `prism-select experiment select`")
    flat = [_flatten(r.get("config") or {}) for r in results]
    diffs, bad = {}, []
    for key in sorted(set().union(*flat)):
        vals = [f.get(key) for f in flat]
        if all(v == vals[0] for v in vals):
            continue
        if key in _PER_SEED_CONFIG:
            continue
        if key not in allow:
            bad.append(key)
            continue
        by = {}
        for r, v in zip(results, vals):
            by.setdefault(json.dumps(v), []).extend(r.get("seeds") or [])
        diffs[key] = [{"value": json.loads(v), "seeds": s} for v, s in by.items()]
    if bad:
        raise InputError(f"the configs differ in {', '.join(bad)}", fix="combine runs of one config, or allow "
                         "the keys that may differ (aggregate_seeds.py --allow KEY)")
    fps = {json.dumps((r.get("model") or {}).get("fingerprint")) for r in results}
    if len(fps) > 1:
        raise InputError("the runs used different start models (model.fingerprint differs)")
    mt = (results[0]["config"] or {}).get("multitask") or {}
    target = _targets(mt) or None
    by_seed: dict = {}
    for r in results:
        for run in r.get("runs", []):
            by_seed.setdefault(run["seed"], []).append(run)
    runs = [merge_task_runs(parts, target or []) for _, parts in sorted(by_seed.items())]
    seeds = [run["seed"] for run in runs]
    methods = list(dict.fromkeys(m for r in results for m in r.get("methods", [])))
    cfg = {**results[0]["config"], "seeds": seeds}
    if mt:
        cfg["multitask"] = {**mt, "select_for": sorted({t for r in results for t in _selected(r)},
                                                       key=(target or []).index)}
        if cfg["multitask"]["select_for"] == target:
            cfg["multitask"]["select_for"] = []
    # each file's step timings, keyed by its seeds ("0", "1,2") and any tasks it alone selected for
    timings = {}
    for r in results:
        only = (r["config"].get("multitask") or {}).get("select_for") or []
        timings[",".join(map(str, r.get("seeds") or [])) + "".join(f"/{t}" for t in only)] = r.get("timings")
    tables = select_tables(runs, methods, cfg["fraction"], target)
    return {"protocol": "select", "config": cfg, "config_differences": diffs, "methods": methods,
            "settings": tables[0]["columns"], "seeds": seeds, "runs": runs, "tables": tables,
            "model": results[0].get("model"), "timings_by_seeds": timings}


def _targets(mt: dict) -> list:
    """The target tasks of a multitask config as results.json records it."""
    return mt.get("target_tasks") or ([mt["target_task"]] if mt.get("target_task") else [])


def _selected(result: dict) -> list:
    """The target tasks a results.json selected for (every one unless ``select_for``)."""
    mt = result["config"].get("multitask") or {}
    return mt.get("select_for") or _targets(mt)


def merge_task_runs(parts: list, target_tasks: list) -> dict:
    """One seed's run from runs of that seed that selected for different target tasks of
    the same multitask pool (``multitask.select_for``), as one run selecting for all of
    them writes it: the accuracy rows hold every task (``mean`` over them), the shares
    per task and their mean, the methods' records per task. ``Start`` and ``Full data``
    come from each part for its own tasks (the same seed trains the same Full-data SFT).
    A single part is returned as it is."""
    if len(parts) == 1:
        return parts[0]
    seed = parts[0]["seed"]
    tasks = [t for p in parts for t in p.get("tasks") or {}]
    if any("tasks" not in p for p in parts) or len(set(tasks)) != len(tasks):
        raise InputError(f"seed {seed} occurs twice among the runs",
                         fix="combine each seed once, or runs of it that selected for different target tasks "
                             "(--target-tasks)")
    order = {t: i for i, t in enumerate(target_tasks)}
    parts = sorted(parts, key=lambda p: min(order.get(t, len(order)) for t in p["tasks"]))
    run = copy.deepcopy(parts[0])  # the others added as the tasks of one run are, in the config's order
    for p in parts[1:]:
        run["tasks"].update(p["tasks"])
        run["methods_by_task"].update(p["methods_by_task"])
        for metric in METRICS:
            for row, values in (p.get(metric) or {}).items():
                merge_values(run, metric, row, values)
        for ft, by in (p.get("by_finetune_seed") or {}).items():
            into = run.setdefault("by_finetune_seed", {}).setdefault(ft, {})
            for metric in METRICS:
                for row, values in (by.get(metric) or {}).items():
                    merge_values(into, metric, row, values)
        for name in ("target_task_share", "mislabeled_share"):
            for task, shares in (p.get(f"{name}_by_task") or {}).items():
                for m, value in shares.items():
                    _set_share(run, name, task, m, value)
    run["methods"] = _methods_of_tasks(run["methods_by_task"])
    return run


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out
