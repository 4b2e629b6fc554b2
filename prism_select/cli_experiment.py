"""The ``prism-select experiment`` verb: run a protocol (``ranking``, ``repair``, ``select``)
from a config, and rebuild its results tables from what a run folder or results.json holds
(``rows KIND``, ``merge``, ``aggregate``; :mod:`prism_select.evaluation.tables`). A thin
shell: the parsers, and commands that call the public functions and write their output.
The evaluation modules are imported when a command runs, so that ``--help`` stays fast."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .errors import InputError

EXAMPLES = {
    "run": "example:\n  prism-select experiment {name} --config experiments/gsm8k.yaml --out runs/{name} --seeds 0 1 2",
    "rows": "example:\n  prism-select experiment rows repair RUN_DIR --config experiments/dropped_carry.yaml --json rows.json",
    "repair": "example:\n  prism-select experiment rows repair RUN_DIR --config experiments/dropped_carry.yaml "
              "--json rows.json --markdown rows.md --plot dose-response.png",
    "retrained": "example:\n  prism-select experiment rows retrained RUN_DIR --task gsm8k --with-rows old.json --json rows.json",
    "rankings": "example:\n  prism-select experiment rows rankings RUN_DIR --floors --family dropped_carry --paired prism "
                "--json rows.json",
    "select": "example:\n  prism-select experiment rows select RUN_DIR --config experiments/carry_select.yaml "
              "--json rows.json --markdown rows.md",
    "shares": "example:\n  prism-select experiment rows shares RUN_DIR [RUN_DIR ...] --fraction 0.05 --json shares.json",
    "offsets": "example:\n  prism-select experiment rows offsets RUN_DIR --json offsets.json",
    "composition": "example:\n  prism-select experiment rows composition RUN_DIR --removal 20 --json composition.json",
    "merge": "example:\n  prism-select experiment merge MAIN/results.json LATER/results.json --methods saefeat "
             "--json merged.json",
    "aggregate": "example:\n  prism-select experiment aggregate seed0/results.json seed1/results.json "
                 "--against random --json results-2seeds.json",
}


def _cell_text(c: dict) -> str:
    """A table cell as the terminal shows it: mean +- sd, or for a paired difference its
    mean and 95% interval."""
    if c["mean"] is None:
        return "-"
    if c.get("ci"):
        return f"{c['mean']:+.3f} [{c['ci'][0]:+.3f}, {c['ci'][1]:+.3f}]"
    return f"{c['mean']:.3f}" + (f" +- {c['std']:.3f}" if c["std"] is not None else "")


def cmd_experiment(a):
    from .evaluation.protocols import run_experiment
    results = run_experiment(a.protocol, a.config, a.out, seeds=a.seeds, smoke=a.smoke,
                             data_root=a.data_root, overwrite=a.overwrite, jobs=a.jobs,
                             target_tasks=a.target_tasks, harmful_ratios=a.harmful_ratios)
    out = Path(a.out)
    for t in results["tables"]:
        print(t["title"])
        print("  " + " | ".join(["method"] + [str(c) for c in t["columns"]]))
        for r in t["rows"]:
            print("  " + " | ".join([r.get("title") or r["label"]] + [_cell_text(c) for c in r["cells"]]))
    print(f"wrote {out / 'results.json'}" + (f" and {out / 'report.html'}" if (out / "report.html").exists() else ""))


def _write(path, text: str) -> None:
    if path:
        Path(path).write_text(text)


def _refuse(text: str, rc: int = 1) -> int:
    """Nothing to table (rc 1) or a folder this kind does not read (rc 2): said on stderr."""
    print(text, file=sys.stderr)
    return rc


def _one_run(a) -> Path:
    if len(a.run_dir) != 1:
        raise InputError(f"rows {a.kind} reads one run folder, got {len(a.run_dir)}")
    return Path(a.run_dir[0])


def cmd_rows(a):
    from .evaluation.config import load_config
    from .evaluation.tables import ranking, removals, repair, select
    if a.kind == "repair":
        cfg = load_config(a.config, "repair")
        seeds = repair.collect(_one_run(a), cfg, a.variant, a.task)
        t = repair.tables(seeds, cfg)
        _write(a.json, json.dumps({"seeds": seeds, "tables": t}, indent=1, default=str))
        md = repair.markdown(t, cfg)
        _write(a.markdown, md)
        if a.plot:
            repair.plot(seeds, t, cfg, Path(a.plot))
        print(md)
    elif a.kind == "retrained":
        run_dir = _one_run(a)
        if repair.several_finetune_seeds(run_dir):
            return _refuse(f"{run_dir} holds retrainings under several fine-tuning seeds (retrain/<hash>-ft<seed>), "
                           "which this script does not read: use experiments/repair_rows_from_files.py RUN_DIR "
                           "--config CONFIG", 2)
        rows = repair.retrained_rows(run_dir, a.task)
        if a.with_rows:
            have = {r["seed"] for r in rows}
            rows += [r for r in json.loads(Path(a.with_rows).read_text())["rows"] if r["seed"] not in have]
        if not rows:
            return _refuse(f"no finished responses under {run_dir}/runs/*/seed*/")
        summ = repair.retrained_summary(rows)
        print(repair.retrained_markdown(summ))
        _write(a.json, json.dumps({"rows": rows, "summary": summ}, indent=1) + "\n")
    elif a.kind == "rankings":
        run_dir = _one_run(a)
        fractions = [float(x) for x in a.fractions.split(",")]
        rows = ranking.rankings(run_dir, fractions, a.label, a.scored_model)
        if a.floors:
            rows += ranking.floor_rows(run_dir, a.label, a.family)
        try:
            rows = ranking.add_rows(rows, a.add, a.add_methods)
        except InputError as exc:  # rows this folder has too
            return _refuse(str(exc))
        if not rows:
            return _refuse(f"no scored methods under {run_dir}/runs/*/seed*/")
        summ = ranking.summary(rows, fractions)
        print(ranking.summary_markdown(summ, fractions))
        extra = {}
        if a.paired:
            extra["paired"] = diffs = ranking.paired(rows, fractions, a.paired)
            print(ranking.paired_markdown(diffs, fractions, a.paired))
        _write(a.json, json.dumps({"rows": rows, "summary": summ, **extra}, indent=1) + "\n")
    elif a.kind == "select":
        res = select.rows_from_files(_one_run(a), load_config(a.config, "select", data_root="."))
        text = select.markdown(res)
        print(text)
        _write(a.json, json.dumps(res, indent=1))
        _write(a.markdown, text)
    elif a.kind == "shares":
        rows = select.selection_rows(a.run_dir, a.fraction)
        print(select.selection_markdown(rows))
        _write(a.json, json.dumps(rows, indent=1) + "\n")
    elif a.kind == "offsets":
        run_dir = _one_run(a)
        table = removals.offset_rows(run_dir, a.targets)
        if not table:
            return _refuse(f"no finished retrainings under {run_dir}/runs/*/seed*/")
        print(removals.offsets_markdown(table))
        _write(a.json, json.dumps({n: {t: dict(c) for t, c in by.items()} for n, by in table.items()}, indent=1) + "\n")
    elif a.kind == "composition":
        run_dir = _one_run(a)
        table = removals.composition_rows(run_dir, a.removal, a.targets)
        if not table:
            return _refuse(f"no removals under {run_dir}/runs/*/seed*/{a.targets}/removal/k{a.removal}/")
        print(removals.composition_markdown(table, a.removal))
        _write(a.json, json.dumps(table, indent=1) + "\n")


def cmd_merge(a):
    from .evaluation.general_selection import read_results
    from .evaluation.tables.merge import merge
    from .io import atomic_write_json
    merged = merge(*read_results([a.main, a.later]), a.methods, tuple(a.dirs) if a.dirs else None, a.suffix)
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(Path(a.json), merged)
    print(f"wrote {a.json}: {', '.join(m + a.suffix for m in a.methods)} added; checked by "
          + "; ".join(f"seed {s}: {', '.join(r)}" for s, r in merged["merged"][-1]["checked_rows"].items()))


def cmd_aggregate(a):
    from .evaluation.general_selection import read_results
    from .evaluation.tables.merge import aggregate, aggregate_text
    from .io import atomic_write_json
    res = aggregate(read_results(a.results), allow=tuple(a.allow), against=tuple(a.against), sources=a.results)
    if a.json:
        atomic_write_json(Path(a.json), res)
    print(aggregate_text(res, a.against, a.task))


def _run_args(p) -> None:
    p.add_argument("--config", required=True, help="YAML or JSON config (see prism_select.evaluation.protocols)")
    p.add_argument("--out", required=True, help="experiment directory (rerun the same command to resume)")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="override the config's seeds")
    p.add_argument("--smoke", action="store_true", help="apply the config's 'smoke' section (a tiny variant)")
    p.add_argument("--data-root", default=None, help="resolve relative data paths here "
                   "(default $PRISM_DATA_ROOT, else the config's data_root)")
    p.add_argument("--overwrite", action="store_true", help="replace an experiment with another config in --out")
    p.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="repair: run the retrainings in N worker processes once every setting is scored "
                        "(same results; on a GPU a small model's SFTs share the device)")
    p.add_argument("--target-tasks", nargs="+", default=None, metavar="TASK",
                   help="select: select for these target tasks of a multitask pool only (the pool is the same; "
                        "runs that split the tasks, e.g. one per GPU, merge with prism-select experiment aggregate)")
    p.add_argument("--harmful-ratios", type=float, nargs="+", default=None, metavar="R",
                   help="ranking / repair: these harmful ratios instead of the config's (runs of other ratios "
                        "may share --out, e.g. one process per ratio, as runs of other --seeds do)")
    p.set_defaults(func=cmd_experiment)


_RUN_HELP = {"ranking": "ranking AUROC on mixed pools", "repair": "filter-and-retrain repair",
             "select": "select-and-fine-tune"}


def _rows_parsers(rows, make) -> None:
    kinds = rows.add_subparsers(dest="kind", required=True, metavar="KIND")
    kind_help = {"repair": "a repair experiment's rows, AUROC, floors and paired differences (needs --config)",
                 "retrained": "behaviour rate and capability of each finished retraining (no fine-tuning seeds)",
                 "rankings": "AUROC and recall of every scored method, per setting, target set and seed",
                 "select": "a select experiment's tables rebuilt from its files (needs --config)",
                 "shares": "what each method's top fraction of a select experiment holds",
                 "offsets": "the retrained rows' wrong answers by their offset from the true sum (dropped carry)",
                 "composition": "what each removal takes out of the pool, by kind and surface form (dropped carry)"}
    for kind, text in kind_help.items():
        p = make(kinds, kind, EXAMPLES[kind], help=text)
        p.add_argument("run_dir", nargs="+", help="the experiment's --out folder" + (
            "s (a seed, task and method found in several is read from the first)" if kind == "shares" else ""))
        p.add_argument("--json", help="write the rows here (JSON)")
        if kind in ("repair", "select"):
            p.add_argument("--config", required=True, help="the experiment's config")
            p.add_argument("--markdown", help="write the printed tables here")
        p.set_defaults(func=cmd_rows)
    p = kinds.choices["repair"]
    p.add_argument("--variant", default="probes", help="the target set whose removals are read")
    p.add_argument("--task", default="carry", help="the behaviour probes' task")
    p.add_argument("--plot", help="a PNG of the dose-response")
    p = kinds.choices["retrained"]
    p.add_argument("--task", default="gsm8k", help="the probes' behaviour task (the others are the capability check)")
    p.add_argument("--with-rows", metavar="OLD.json",
                   help="an earlier --json of the same experiment: its rows of seeds RUN_DIR lacks are added")
    p = kinds.choices["rankings"]
    p.add_argument("--fractions", default="0.05,0.1,0.2", help="the recall columns' top fractions")
    p.add_argument("--label", default="harmful", help="the pool records' flag the AUROC ranks")
    p.add_argument("--floors", action="store_true", help="add the floors of every pool and target set")
    p.add_argument("--family", choices=["dropped_carry"], help="with --floors: that family's knowledge floors too")
    p.add_argument("--add", nargs="*", default=[], metavar="JSON",
                   help="the rows of earlier --json files too (runs of the same config in other folders, e.g. "
                        "other seeds); a (setting, targets, method, seed) this folder also has is refused")
    p.add_argument("--add-methods", nargs="+", metavar="METHOD",
                   help="with --add: only these methods' rows of the added files (a run that re-scored some "
                        "methods on the same pools also holds random's and the floors' rows)")
    p.add_argument("--scored-model", default="the scored model",
                   help="what the scored model is, for the judge's row when it judges with it (e.g. 'the start model')")
    p.add_argument("--paired", metavar="METHOD",
                   help="that method minus every other row, paired by seed, with 95%% t intervals")
    kinds.choices["shares"].add_argument("--fraction", type=float, default=0.05, help="the selection's share of the pool")
    for kind in ("offsets", "composition"):
        kinds.choices[kind].add_argument("--targets", default="probes", help="the target set whose removals are read")
    kinds.choices["composition"].add_argument("--removal", type=int, default=20,
                                              help="the removal's percentage (its k<PCT> folder)")


def add_experiment_parser(sub, make) -> None:
    """The ``experiment`` verb and its sub-verbs on ``sub``; ``make(sub, name, epilog,
    **kw)`` makes one parser in the CLI's help style."""
    ex = make(sub, "experiment", EXAMPLES["run"].format(name="ranking"),
              help="run an evaluation protocol (ranking, repair, select) from a config, or rebuild its tables")
    verbs = ex.add_subparsers(dest="protocol", required=True, metavar="PROTOCOL")
    for name, text in _RUN_HELP.items():
        _run_args(make(verbs, name, EXAMPLES["run"].format(name=name), help=text))
    rows = make(verbs, "rows", EXAMPLES["rows"], help="rebuild an experiment's tables from its run folders "
                "(finished or not; nothing is trained or scored)")
    _rows_parsers(rows, make)
    mg = make(verbs, "merge", EXAMPLES["merge"],
              help="add the rows of methods scored in a later select run to the first run's results.json")
    mg.add_argument("main", help="results.json of the first run")
    mg.add_argument("later", help="results.json of the run that scored --methods")
    mg.add_argument("--methods", nargs="+", required=True, help="the later run's rows to add")
    mg.add_argument("--dirs", nargs=2, metavar=("MAIN_DIR", "LATER_DIR"),
                    help="the two experiment folders: check that their data files are identical")
    mg.add_argument("--suffix", default="", help="append this to the added rows' names, e.g. ' (CPU)'")
    mg.add_argument("--json", "--out", dest="json", required=True, help="merged results.json")
    mg.set_defaults(func=cmd_merge)
    ag = make(verbs, "aggregate", EXAMPLES["aggregate"],
              help="combine the results.json files of a select experiment run one seed per call")
    ag.add_argument("results", nargs="+", help="results.json files of `prism-select experiment select`")
    ag.add_argument("--allow", nargs="*", default=[], metavar="KEY",
                    help="dotted config keys that may differ between the files (listed in the output)")
    ag.add_argument("--json", "--out", dest="json", help="write the combined results here (JSON)")
    ag.add_argument("--against", nargs="*", default=["random", "Full data"], metavar="ROW",
                    help="rows to take paired differences from (none: pass --against alone)")
    ag.add_argument("--task", default="mean",
                    help="the printed tables' column: a target task, or mean (the JSON holds every one)")
    ag.set_defaults(func=cmd_aggregate)

