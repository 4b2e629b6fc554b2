"""The general-selection protocol (the paper's App. E): the top ``fraction`` (5%) of a
pool by each method (and ``random``) for per-task target pairs -> LoRA SFT
(``general`` preset) -> accuracy on each task's held-out probes; rows ``Start`` and
``Full data``. The experiment directory: :mod:`.experiment`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import InputError
from . import builders
from .config import SelectConfig, config_to_dict
from .experiment import (Experiment, accuracy_by_task, finish_experiment, load_start, mean_std, pct,
                         read_jsonl, resolve_methods, respond, score_methods, train_adapter, write_if_changed)


def select(config: SelectConfig, out_dir, *, overwrite: bool = False) -> dict:
    """The general-selection protocol (module docstring); returns results.json's content."""
    from ..selection import choose, read_scores, write_subset
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
        if cfg.multitask is not None:
            mt = cfg.multitask
            pool, targets, heldout = builders.multitask_splits(
                mt.gsm8k_train, mt.bbh_dir, mt.tasks, mt.target_task, n_gsm8k=mt.n_gsm8k, n_per_task=mt.n_per_task,
                n_targets=mt.n_targets, n_heldout=mt.n_heldout, seed=seed)
            pool_path, targets_path, heldout_path = sdir / "pool.jsonl", sdir / "targets.jsonl", sdir / "heldout.jsonl"
            for path, recs in ((pool_path, pool), (targets_path, targets), (heldout_path, heldout)):
                write_if_changed(path, recs)
        elif cfg.bbh is not None:
            targets, heldout = builders.bbh_splits(cfg.bbh.dir, cfg.bbh.n_targets_per_task, seed,
                                                   tasks=cfg.bbh.tasks, n_heldout_per_task=cfg.bbh.n_heldout_per_task)
            targets_path, heldout_path = sdir / "targets.jsonl", sdir / "heldout.jsonl"
            write_if_changed(targets_path, targets)
            write_if_changed(heldout_path, heldout)
        else:
            targets_path, heldout_path = Path(cfg.targets), Path(cfg.heldout)
        run = {"setting": "select", "seed": seed, "dir": exp.rel(sdir), "pool": os.path.relpath(pool_path, exp.out),
               "targets": os.path.relpath(targets_path, exp.out), "heldout": os.path.relpath(heldout_path, exp.out),
               "label": None, "accuracy": {}, "n_selected": None}
        run["methods"] = score_methods(exp, lm, pool_path, targets_path, sdir, methods, seed, label=None)
        if cfg.start_row:
            resp = respond(exp, lm, heldout_path, sdir / "start", cfg.checker, "start")
            run["accuracy"]["Start"] = accuracy_by_task(resp)
        if cfg.full_data:
            adapter = train_adapter(exp, lm, pool_path, sdir / "full", seed, "full")
            resp = respond(exp, lm, heldout_path, sdir / "full", cfg.checker, "full", adapter)
            run["accuracy"]["Full data"] = accuracy_by_task(resp)
        for m in methods:
            if run["methods"][m].get("status") != "ok":
                continue
            mdir = sdir / "selected" / m
            mdir.mkdir(parents=True, exist_ok=True)
            scores = read_scores(exp.out / run["methods"][m]["dir"] / "scores.jsonl")
            kept = choose(scores, keep=("fraction", cfg.fraction))
            ext = pool_path.suffix if pool_path.is_file() else ""
            subset = mdir / f"subset{ext or '.jsonl'}"
            run["n_selected"] = write_subset(pool_path, kept, subset)
            if cfg.multitask is not None:
                share = [r.get("task") == cfg.multitask.target_task for r in read_jsonl(subset)]
                run.setdefault("target_task_share", {})[m] = sum(share) / len(share) if share else None
            adapter = train_adapter(exp, lm, subset, mdir, seed, f"select:{m}")
            resp = respond(exp, lm, heldout_path, mdir, cfg.checker, f"select:{m}", adapter)
            run["accuracy"][m] = accuracy_by_task(resp)
        runs.append(run)
    tables = select_tables(runs, methods, cfg.fraction,
                           cfg.multitask.target_task if cfg.multitask is not None else None)
    results = {"protocol": "select", "config": config_to_dict(cfg), "methods": methods,
               "settings": tables[0]["columns"], "seeds": cfg.seeds, "runs": runs, "tables": tables,
               "model": {"fingerprint": lm.fingerprint, **{k: v for k, v in lm.source.items() if k != "versions"}}}
    return finish_experiment(exp, results)


def select_tables(runs: list, methods: list, fraction: float, target_task: str | None = None) -> list:
    """results.json's tables from the runs (seeds) of a select experiment: held-out
    accuracy per row and task, and with ``target_task`` (a multitask pool) the share of
    each method's selection from that task; cells are :func:`.mean_std` over the runs."""
    tasks = list(dict.fromkeys(t for r in runs for acc in r["accuracy"].values() for t in acc if t != "mean"))
    columns = tasks + ["mean"]
    row_keys = list(dict.fromkeys(k for r in runs for k in r["accuracy"]))
    ordered = [k for k in ("Start", "Full data") if k in row_keys] + [k for k in row_keys if k not in ("Start", "Full data")]

    def acc(run, m, task):
        return (run["accuracy"].get(m) or {}).get(task)

    table = {"name": "accuracy", "title": f"Held-out accuracy after fine-tuning on the top {pct(fraction)}% "
             "(higher is better)", "columns": columns, "lower_is_better": False,
             "note": "Start: no fine-tuning; Full data: fine-tuned on the whole pool",
             "rows": [{"label": k, "cells": [mean_std([acc(r, k, c) for r in runs]) for c in columns]}
                      for k in ordered]}
    tables = [table]
    if target_task is not None:
        tables.append({"name": "target_task_share", "title": f"Share of the selected records from the target task "
                       f"{target_task} (its share of the pool is the random row's expectation)",
                       "columns": ["share"], "lower_is_better": False, "note": "",
                       "rows": [{"label": m, "cells": [mean_std([(r.get("target_task_share") or {}).get(m)
                                                                 for r in runs])]} for m in methods]})
    return tables


# what may differ between the results.json files of one experiment's seeds
_PER_SEED_CONFIG = ("seeds", "data_root", "multitask.gsm8k_train", "multitask.bbh_dir", "report")


def combine_seeds(results: list, *, allow: tuple = ()) -> dict:
    """One select experiment's results from the results.json contents of runs with
    other seeds (each run on its own, e.g. one device call per seed): the runs merged in
    seed order and the tables recomputed over all of them, as ``experiment select
    --seeds ...`` writes them for one output folder. Every number comes from the runs'
    recorded accuracies and shares; scores and responses are not needed.

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
    runs = sorted((run for r in results for run in r.get("runs", [])), key=lambda run: run["seed"])
    seeds = [run["seed"] for run in runs]
    if len(set(seeds)) != len(seeds):
        raise InputError(f"a seed occurs twice among the runs ({seeds})")
    methods = list(dict.fromkeys(m for r in results for m in r.get("methods", [])))
    cfg = {**results[0]["config"], "seeds": seeds}
    target = (cfg.get("multitask") or {}).get("target_task")
    # each file's step timings, keyed by its seeds ("0", "1,2")
    timings = {",".join(map(str, r.get("seeds") or [])): r.get("timings") for r in results}
    tables = select_tables(runs, methods, cfg["fraction"], target)
    return {"protocol": "select", "config": cfg, "config_differences": diffs, "methods": methods,
            "settings": tables[0]["columns"], "seeds": seeds, "runs": runs, "tables": tables,
            "model": results[0].get("model"), "timings_by_seeds": timings}


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out
