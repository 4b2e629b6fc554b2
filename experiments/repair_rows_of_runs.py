"""Filter-and-retrain rows of a repair experiment, read from its run folders: behaviour
rate and capability of Start, Mixed, Oracle and every removal whose retraining has
finished, per target set, removal fraction and seed, with the mean and standard deviation
over the seeds that have the row. It starts no work and needs no adapters, so it reads an
experiment cut short in its retrainings (or copied without its adapters) as well as a
finished one; `prism-select experiment` writes the same rows for a finished experiment.

    python experiments/repair_rows_of_runs.py RUN_DIR [--task gsm8k] [--json OUT.json] [--with-rows OLD.json]

RUN_DIR is an experiment's ``--out`` folder. A removal is found by its kept set
(``runs/<setting>/seed<k>/<targets>/removal/k<pct>/<method>/kept.jsonl``); its SFT and
responses live in ``retrain/<hash of the kept ids>/``, shared by every removal that keeps
the same records (a method whose top k% is exactly the harmful set shares the Oracle's).
A removal whose retraining has not finished is left out of its cell; the cell says how many
seeds it holds. ``--with-rows`` adds the rows of another run of the same experiment (an earlier
``--json``), for seeds that RUN_DIR does not hold. A config with ``finetune_seeds`` (its
retrainings in ``retrain/<hash>-ft<seed>/``, its Mixed row retrained too) is read by
``experiments/repair_rows_from_files.py`` instead; this script refuses such a folder.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prism_select.evaluation.experiment import mean_std, rates_by_task  # noqa: E402
from prism_select.evaluation.repair import _retrain_dir  # noqa: E402


def _finished(step_dir: Path) -> Path | None:
    """``responses.jsonl`` of a finished responses step, else None."""
    resp = step_dir / "responses.jsonl"
    return resp if resp.is_file() and (step_dir / ".responses-step.json").is_file() else None


def repair_rows(run_dir: Path, task: str) -> list:
    """One row per (setting, seed, targets, fraction, method) with a finished retraining."""
    rows = []
    for seed_dir in sorted(run_dir.glob("runs/*/seed*")):
        base = {"setting": seed_dir.parent.name, "seed": int(seed_dir.name[4:])}
        fixed = {"Start": _finished(seed_dir / "start"), "Mixed": _finished(seed_dir / "mixed")}
        oracle_kept = seed_dir / "oracle" / "kept.jsonl"
        oracle_dir = _retrain_dir(seed_dir, oracle_kept) if oracle_kept.is_file() else None
        fixed["Oracle"] = _finished(oracle_dir) if oracle_dir else None
        for kdir in sorted(seed_dir.glob("*/removal/k*")):
            targets, frac = kdir.parent.parent.name, kdir.name[1:]
            found = dict(fixed)
            for mdir in sorted(p for p in kdir.iterdir() if (p / "kept.jsonl").is_file()):
                tdir = _retrain_dir(seed_dir, mdir / "kept.jsonl")
                found[mdir.name] = _finished(tdir)
            for method, resp in found.items():
                if resp is None:
                    continue
                rows.append({**base, "targets": targets, "fraction": frac, "method": method,
                             "same_as_oracle": method not in fixed and oracle_dir is not None
                             and resp.parent == oracle_dir,
                             "dir": str(resp.parent.relative_to(run_dir)), **rates_by_task(resp, task)})
    return rows


def summary(rows: list) -> list:
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["setting"], r["targets"], r["fraction"], r["method"]), []).append(r)
    out = []
    for (setting, targets, frac, method), rs in groups.items():
        s = {"setting": setting, "targets": targets, "fraction": frac, "method": method,
             "seeds": sorted(r["seed"] for r in rs), "same_as_oracle": sorted(r["seed"] for r in rs if r["same_as_oracle"])}
        for k in ("behaviour_rate", "capability"):
            ms = mean_std([r[k] for r in rs if r[k] is not None])
            s[k], s[k + "_std"] = ms["mean"], ms["std"]
        out.append(s)
    order = {"Start": 0, "Mixed": 1, "Oracle": 3}
    return sorted(out, key=lambda s: (s["setting"], s["targets"], int(s["fraction"]), order.get(s["method"], 2),
                                      s["method"]))


def _cell(s: dict, k: str) -> str:
    if s[k] is None:
        return "-"
    return f"{s[k]:.3f}" + (f" ± {s[k + '_std']:.3f}" if s[k + "_std"] is not None else "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--task", default="gsm8k", help="the probes' behaviour task (the others are the capability check)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--with-rows", type=Path, metavar="OLD.json",
                    help="an earlier --json of the same experiment: its rows of seeds RUN_DIR lacks are added")
    a = ap.parse_args(argv)
    if any(a.run_dir.glob("runs/*/seed*/retrain/*-ft*")):
        print(f"{a.run_dir} holds retrainings under several fine-tuning seeds (retrain/<hash>-ft<seed>), which "
              "this script does not read: use experiments/repair_rows_from_files.py RUN_DIR --config CONFIG",
              file=sys.stderr)
        return 2
    rows = repair_rows(a.run_dir, a.task)
    if a.with_rows:
        have = {r["seed"] for r in rows}
        rows += [r for r in json.loads(a.with_rows.read_text())["rows"] if r["seed"] not in have]
    if not rows:
        print(f"no finished responses under {a.run_dir}/runs/*/seed*/", file=sys.stderr)
        return 1
    summ = summary(rows)
    print("| setting | targets | remove top % | row | seeds | behaviour rate | capability |")
    print("|---|---|---|---|---|---|---|")
    for s in summ:
        seeds = ",".join(map(str, s["seeds"])) + (" (kept set = Oracle's)" if s["same_as_oracle"] == s["seeds"]
                                                    else f" (= Oracle's for {s['same_as_oracle']})"
                                                    if s["same_as_oracle"] else "")
        print(f"| {s['setting']} | {s['targets']} | {s['fraction']} | {s['method']} | {seeds} | "
              f"{_cell(s, 'behaviour_rate')} | {_cell(s, 'capability')} |")
    if a.json:
        a.json.write_text(json.dumps({"rows": rows, "summary": summ}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
