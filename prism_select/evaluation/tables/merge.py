"""Add the rows of methods scored in a later run to a select experiment's results.json.

A method that failed in a run (say, SAE-Feat without an SAE) can be run again on its own,
on the same seeds, with the same data: `experiment select` with a config that lists only
that method (and a control such as ``random``), ``full_data: false`` and ``start_row:
false``. This script copies the later run's rows of ``--methods`` into the first run's
results, seed by seed, after checking that the two runs share their data: every row the
two hold in common (the control) must have the same accuracies, and with ``--dirs`` the
seed's pool, target pairs and held-out probes must be byte-identical. The merged files
then go to :func:`aggregate` as any other.

    prism-select experiment merge MAIN/results.json LATER/results.json --methods saefeat \
        [--dirs MAIN LATER] --json merged/results.json

:func:`aggregate` (``prism-select experiment aggregate A/results.json B/results.json
--json FILE``) combines the results.json files of a select experiment run one seed per
call (only its results.json comes back from a device call; the adapters stay on the
machine, so a rerun here would fine-tune again): with
:func:`~prism_select.evaluation.general_selection.combine_seeds` (the same tables, mean
and sample std over seeds, as the experiment writes), plus the paired differences from
some rows (the seeds share their pool and probes within a seed, so row minus row is taken
seed by seed; ``paired_differences``), and, for a multitask pool, how the target-task
share of a selection goes with its gain over random (``share_vs_gain``).
"""

from __future__ import annotations

import copy
import statistics
from pathlib import Path

from ...errors import InputError
from ...io import sha256_file
from ..experiment import paired_interval
from ..general_selection import combine_seeds

#: per-run keys that hold one entry per row or method (``*_by_task``: one per task, then method)
ROW_KEYS = ("accuracy", "balanced_accuracy", "target_task_share", "mislabeled_share", "methods")
BY_TASK_KEYS = ("target_task_share_by_task", "mislabeled_share_by_task", "methods_by_task")
#: a common row's accuracies may differ by at most this much (the same fine-tuning on the
#: same data repeats them exactly on one machine; this allows rounding in the JSON)
SAME_ACCURACY_TOL = 1e-9


def _data_files(run: dict) -> list:
    files = [run["pool"]] + [run[k] for k in ("targets", "heldout") if run.get(k)]
    for t in (run.get("tasks") or {}).values():
        files += [t["targets"], t["heldout"]]
    return sorted(set(files))


def _selected_for(res: dict) -> list:
    """The target tasks a multitask run selected for (``[]``: every task, or no multitask pool)."""
    mt = (res.get("config") or {}).get("multitask") or {}
    return list(mt.get("select_for") or [])


def merge(main: dict, later: dict, methods: list, dirs: tuple | None = None, suffix: str = "") -> dict:
    """``main`` with ``later``'s rows of ``methods`` added to the run of each seed.

    A later run that selected for some of the target tasks only (``--target-tasks``) is
    checked and copied on those tasks: its ``mean`` covers fewer tasks than the first run's,
    so the added rows carry the per-task accuracies and shares and no mean. ``suffix`` is
    appended to the added rows' names (e.g. `` (CPU)`` for rows fine-tuned on another
    device): a row the first run also holds, such as ``random``, is then added beside it
    rather than checked against it."""
    if main.get("protocol") != "select" or later.get("protocol") != "select":
        raise InputError("both files must be results of `experiment select`")
    if (main.get("model") or {}).get("fingerprint") != (later.get("model") or {}).get("fingerprint"):
        raise InputError("the runs used different start models (model.fingerprint differs)")
    only, first = _selected_for(later), _selected_for(main)
    if only and first and not set(only) <= set(first):
        raise InputError(f"the later run selected for {sorted(set(only) - set(first))}, which the first did not")
    partial = bool(only) and set(only) != set(first)
    runs = {r["seed"]: r for r in main["runs"]}
    out = copy.deepcopy(main)
    out_runs = {r["seed"]: r for r in out["runs"]}
    checked = {}
    for lr in later["runs"]:
        seed = lr["seed"]
        if seed not in runs:
            raise InputError(f"seed {seed} of the later run is not in the first")
        mr = runs[seed]
        common = [k for k in lr["accuracy"] if k in mr["accuracy"] and k not in methods]
        if any(m + suffix in mr["accuracy"] for m in methods):
            raise InputError(f"seed {seed}: the first run already has a row named like an added one "
                             f"({[m + suffix for m in methods if m + suffix in mr['accuracy']]})",
                             fix="add the rows under another name (--suffix)")
        if not common:
            raise InputError(f"seed {seed}: the runs share no row to check their data by",
                             fix="run a control method (e.g. random) in the later run too")
        for key in ("accuracy", "balanced_accuracy"):
            for k in common:
                a, b = (mr.get(key) or {}).get(k) or {}, (lr.get(key) or {}).get(k) or {}
                keys = set(only) if partial else set(a) | set(b)
                bad = [t for t in keys if abs((a.get(t) or 0) - (b.get(t) or 0)) > SAME_ACCURACY_TOL]
                if bad:
                    raise InputError(f"seed {seed}: row {k!r} has other {key} in the later run ({a} vs {b}): the "
                                     "runs do not share their data or fine-tuning")
        if dirs:
            for rel in _data_files(mr):
                a, b = Path(dirs[0]) / rel, Path(dirs[1]) / rel
                if not b.is_file() or sha256_file(a) != sha256_file(b):
                    raise InputError(f"seed {seed}: {rel} differs between the runs", path=b)
        checked[seed] = common
        tgt = out_runs[seed]
        for m in methods:
            if m not in lr["accuracy"]:
                raise InputError(f"seed {seed}: the later run has no row {m!r}")
            for key in ROW_KEYS:
                if m not in (lr.get(key) or {}):
                    continue
                value = lr[key][m]
                if partial and key in ("accuracy", "balanced_accuracy"):
                    value = {t: v for t, v in value.items() if t in only}
                elif partial and key in ("target_task_share", "mislabeled_share"):
                    continue  # a mean over the later run's tasks: the *_by_task keys hold each
                tgt.setdefault(key, {})[m + suffix] = value
            for key in BY_TASK_KEYS:
                for task, per in (lr.get(key) or {}).items():
                    if m in per:
                        tgt.setdefault(key, {}).setdefault(task, {})[m + suffix] = per[m]
    out["methods"] = list(dict.fromkeys(main["methods"] + [m + suffix for m in methods]))
    out["config"]["methods"] = out["methods"]
    out.setdefault("merged", []).append({"methods": methods, "checked_rows": checked, "suffix": suffix})
    return out


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


def aggregate(results: list, allow: tuple = (), against: tuple = ("random", "Full data"), sources: list = ()) -> dict:
    """The select results ``results`` (one per seed) combined (module docstring);
    ``sources``: the files they came from, kept under ``sources``."""
    res = combine_seeds(results, allow=tuple(allow))
    res["sources"] = [str(p) for p in sources]
    res["paired_differences"] = {a: paired(res, a) for a in against}
    res["share_vs_gain"] = share_vs_gain(res)
    if any(t["name"] == "balanced_accuracy" for t in res["tables"]):
        res["paired_differences_balanced"] = {a: paired(res, a, metric="balanced_accuracy") for a in against}
    return res


def aggregate_text(res: dict, against: list, task: str = "mean") -> str:
    """What ``experiment aggregate`` prints: :func:`markdown` of the accuracy (and the
    balanced accuracy), the config keys that differ, and the share-gain correlation."""
    lines = [markdown(res, against, task)]
    if any(t["name"] == "balanced_accuracy" for t in res["tables"]):
        lines += ["\nbalanced over the reference answers:", markdown(res, against, task, metric="balanced_accuracy")]
    for key, groups in res["config_differences"].items():
        lines.append(f"config {key}: " + "; ".join(f"{g['value']} (seeds {g['seeds']})" for g in groups))
    if res["share_vs_gain"] and res["share_vs_gain"]["pearson_r"] is not None:
        c = res["share_vs_gain"]
        lines.append(f"target-task share vs accuracy minus {c['against']}: Pearson r {c['pearson_r']:.2f} "
                     f"over {c['n']} (method, seed) pairs")
    return "\n".join(lines)
