"""Add the rows of methods scored in a later run to a select experiment's results.json.

A method that failed in a run (say, SAE-Feat without an SAE) can be run again on its own,
on the same seeds, with the same data: `experiment select` with a config that lists only
that method (and a control such as ``random``), ``full_data: false`` and ``start_row:
false``. This script copies the later run's rows of ``--methods`` into the first run's
results, seed by seed, after checking that the two runs share their data: every row the
two hold in common (the control) must have the same accuracies, and with ``--dirs`` the
seed's pool, target pairs and held-out probes must be byte-identical. The merged files
then go to `aggregate_seeds.py` as any other.

    python experiments/merge_method_rows.py MAIN/results.json LATER/results.json --methods saefeat \
        [--dirs MAIN LATER] --out merged/results.json
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

from prism_select.errors import InputError, run_script
from prism_select.evaluation.general_selection import read_results
from prism_select.io import atomic_write_json, sha256_file

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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("main", help="results.json of the first run")
    ap.add_argument("later", help="results.json of the run that scored --methods")
    ap.add_argument("--methods", nargs="+", required=True, help="the later run's rows to add")
    ap.add_argument("--dirs", nargs=2, metavar=("MAIN_DIR", "LATER_DIR"),
                    help="the two experiment folders: check that their data files are identical")
    ap.add_argument("--suffix", default="", help="append this to the added rows' names, e.g. ' (CPU)'")
    ap.add_argument("--out", required=True, help="merged results.json")
    args = ap.parse_args(argv)
    merged = merge(*read_results([args.main, args.later]), args.methods, tuple(args.dirs) if args.dirs else None,
                   args.suffix)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(Path(args.out), merged)
    print(f"wrote {args.out}: {', '.join(m + args.suffix for m in args.methods)} added; checked by "
          + "; ".join(f"seed {s}: {', '.join(r)}" for s, r in merged["merged"][-1]["checked_rows"].items()))
    return 0


if __name__ == "__main__":
    run_script(main)
