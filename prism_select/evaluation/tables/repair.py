"""Rows of a repair experiment read from the files its steps left, finished or not.

`prism-select experiment repair` writes results.json at the end; a run stopped before
(a device call's time ran out) still holds every finished step: per seed the Start and
Mixed responses, each method's scores, and each retraining's responses and behaviour
measurements under ``retrain/<hash of the kept ids>[-ft<seed>]``. Two tables come from
these folders:

* :func:`collect` + :func:`tables` (``prism-select experiment rows repair RUN_DIR
  --config C``): for every row (Start, Mixed, Oracle and partial Oracles, each method's
  removal at each fraction), the retrainings that finished; ranking AUROC with the floors,
  behaviour per row (mean over fine-tuning seeds per data seed, then mean, sd and n over
  data seeds), and paired differences with 95% t intervals over data seeds. A row whose
  retrainings did not all finish on a seed leaves that seed out, and says so (n).
* :func:`retrained_rows` + :func:`retrained_summary` (``experiment rows retrained
  RUN_DIR``, no config): behaviour rate and capability per (setting, seed, targets,
  fraction, method) of an experiment without ``finetune_seeds``.

Every retraining folder is read by :func:`finished_responses`. Nothing is trained or
scored; adapters are not needed.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..experiment import (FLOOR_TITLES, mean_std, paired_interval, pct, ranking_metrics, rates_by_task, read_jsonl,
                          row_title)
from ..floors import floors
from ..repair import family_floors, retrain_dir

METRICS = ("behaviour_rate", "harmful_answer_rate", "harmful_preference", "capability")
#: the paired differences' metrics: the behaviour's three (lower is better) and the capability
#: check (higher is better), so that a removal that costs capability shows it beside its gain
PAIRED = ("harmful_preference", "harmful_answer_rate", "behaviour_rate", "capability")


def seed_dirs(run_dir: Path, setting: str = "*") -> list:
    """An experiment's seed folders, ``runs/<setting>/seed<k>``, sorted."""
    return sorted(Path(run_dir).glob(f"runs/{setting}/seed*"))


def removals(seed_dir: Path, targets: str = "*", fraction: str = "*") -> list:
    """A seed's removals, sorted: ``(targets, fraction, method, kept path)`` for every
    ``<targets>/removal/k<fraction>/<method>/kept.jsonl``."""
    return [(p.parents[3].name, p.parents[1].name[1:], p.parent.name, p)
            for p in sorted(Path(seed_dir).glob(f"{targets}/removal/k{fraction}/*/kept.jsonl"))]


def retrainings(seed_dir: Path, kept: Path) -> list:
    """The retraining folders of one kept set: the one named by its records alone, then
    one per fine-tuning seed (``-ft<seed>``), those that exist."""
    base = retrain_dir(seed_dir, kept)
    return [base, *sorted(base.parent.glob(base.name + "-ft*"))]


def finished_responses(step_dir: Path, step: bool = True, behaviour: bool = False,
                       model: str | None = None) -> Path | None:
    """``step_dir/responses.jsonl`` of a finished responses step, else None: with ``step``
    its step record (``.responses-step.json``) must be there, with ``behaviour`` its
    behaviour measurement (``behaviour.json``), and with ``model`` the retraining must
    have started from that start model (:func:`started_from`)."""
    resp = step_dir / "responses.jsonl"
    if not resp.is_file() or (step and not (step_dir / ".responses-step.json").is_file()):
        return None
    if behaviour and not (step_dir / "behaviour.json").is_file():
        return None
    return resp if model is None or started_from(step_dir, model) else None


def measure(tdir: Path, task: str) -> dict | None:
    """A finished retraining's (or start/mixed folder's) rates, None when unfinished."""
    resp = finished_responses(tdir, step=False, behaviour=True)
    if resp is None:
        return None
    return {**rates_by_task(resp, task), **json.loads((tdir / "behaviour.json").read_text())}


def start_model(rdir: Path) -> str | None:
    """The fingerprint of the start model a seed's run trained from (its Mixed SFT's key)."""
    step = rdir / "mixed" / ".finetune-step.json"
    return json.loads(step.read_text()).get("model") if step.is_file() else None


def started_from(tdir: Path, model: str | None) -> bool:
    """Whether a retraining started from ``model``: a folder copied from an earlier run
    whose start model differed holds results of another model under the same records."""
    step = tdir / ".retrain-step.json"
    return model is None or not step.is_file() or json.loads(step.read_text()).get("model") == model


def kept_row(rdir: Path, kept: Path, ft_seeds: list, task: str) -> dict | None:
    """The mean of one kept set's finished retrainings over ``ft_seeds`` (None while one is
    unfinished or started from another model)."""
    model = start_model(rdir)
    dirs = [retrain_dir(rdir, kept, s) for s in ft_seeds]
    rows = [measure(d, task) if started_from(d, model) else None for d in dirs]
    if any(r is None for r in rows):
        return None
    return {k: sum(r[k] for r in rows) / len(rows) for k in METRICS if all(r.get(k) is not None for r in rows)}


def seed_rows(rdir: Path, cfg, variant: str, task: str) -> dict:
    """Every row of one seed and target set that finished: name -> fraction -> metrics."""
    ft = cfg.finetune_seeds or [None]  # None: one SFT per kept set, named by its records alone
    fr = [pct(f) for f in cfg.remove_fractions]
    mixed = kept_row(rdir, rdir / "pool.jsonl", ft, task) if cfg.finetune_seeds else measure(rdir / "mixed", task)
    out = {"Start": dict.fromkeys(fr, measure(rdir / "start", task)), "Mixed": dict.fromkeys(fr, mixed)}
    for q in list(cfg.partial_oracles) + [1.0]:
        name, d = ("Oracle", "oracle") if q == 1.0 else (f"Oracle {pct(q)}%", f"oracle-{pct(q)}")
        if (rdir / d / "kept.jsonl").is_file():
            out[name] = dict.fromkeys(fr, kept_row(rdir, rdir / d / "kept.jsonl", ft, task))
    for f in fr:
        for _, _, method, kept in removals(rdir, variant, f):
            out.setdefault(method, {})[f] = kept_row(rdir, kept, ft, task)
    return out


def collect(run_dir: Path, cfg, variant: str, task: str) -> dict:
    """Per seed: its rows, each method's AUROC and recall, the floors, and the pairs' pi."""
    seeds = {}
    for rdir in seed_dirs(run_dir, "r*"):
        vdir = rdir / variant
        pool = read_jsonl(rdir / "pool.jsonl")
        targets = read_jsonl(vdir / "targets.jsonl")
        n_harm = sum(p["harmful"] for p in pool)
        methods, titles = {}, {}
        for sdir in sorted((vdir / "scores").glob("*")):
            if (sdir / "scores.jsonl").is_file():
                methods[sdir.name] = ranking_metrics(sdir / "scores.jsonl", rdir / "pool.jsonl", "harmful")
                run = json.loads((sdir / "run.json").read_text()) if (sdir / "run.json").is_file() else None
                title = row_title(sdir.name, run, f"the {cfg.score_at} model")
                if title:
                    titles[sdir.name] = title
        recall = {}
        for _, f, method, path in removals(rdir, variant):
            kept = {r["id"] for r in read_jsonl(path)}
            recall.setdefault(f, {})[method] = sum(1 for p in pool if p["harmful"] and p["id"] not in kept) / n_harm
        pis = [json.loads(x)["pi"] for x in (vdir / "scores" / "prism" / "pairs.jsonl").read_text().splitlines()
               if x.strip()] if (vdir / "scores" / "prism" / "pairs.jsonl").is_file() else []
        fl = floors(pool, targets, extra=family_floors() if cfg.data.family == "dropped_carry" else None)
        seeds[rdir.name] = {"rows": seed_rows(rdir, cfg, variant, task), "methods": methods, "recall": recall,
                            "floors": fl, "n_pairs": len(targets), "pi": pis, "titles": titles}
    return seeds


def tables(seeds: dict, cfg) -> dict:
    """The tables of :func:`collect`'s seeds: rows, AUROC, recall, floors and paired differences."""
    names = list(dict.fromkeys(n for s in seeds.values() for n in s["rows"]))
    fr = [pct(f) for f in cfg.remove_fractions]
    out = {"rows": {}, "paired": {}, "auroc": {}, "recall": {}, "floors": {},
           "titles": {**{f"floor: {k}": v for k, v in FLOOR_TITLES.items()},
                      **{m: t for s in seeds.values() for m, t in (s.get("titles") or {}).items()}}}
    for n in names:
        for f in fr:
            for k in METRICS:
                vals = [((s["rows"].get(n) or {}).get(f) or {}).get(k) for s in seeds.values()]
                out["rows"].setdefault(n, {}).setdefault(f, {})[k] = mean_std(vals)
    for m in dict.fromkeys(m for s in seeds.values() for m in s["methods"]):
        out["auroc"][m] = mean_std([s["methods"].get(m, {}).get("auroc") for s in seeds.values()])
        for f in fr:
            out["recall"].setdefault(m, {})[f] = mean_std([s["recall"].get(f, {}).get(m) for s in seeds.values()])
    for fl in dict.fromkeys(k for s in seeds.values() for k in s["floors"]):
        out["floors"][fl] = mean_std([s["floors"][fl]["auroc"] for s in seeds.values()])
    for f in fr:
        for c in cfg.comparators + ["Mixed"]:
            for n in names:
                if n == c:
                    continue
                for k in PAIRED:
                    diffs = []
                    for s in seeds.values():
                        a, b = ((s["rows"].get(n) or {}).get(f) or {}), ((s["rows"].get(c) or {}).get(f) or {})
                        if a and b and a.get(k) is not None and b.get(k) is not None:
                            diffs.append(a[k] - b[k])
                    if diffs:
                        out["paired"].setdefault(f"k{f} vs {c}", {}).setdefault(n, {})[k] = paired_interval(diffs)
    return out


def _fmt(c: dict, ci: bool = False) -> str:
    if not c or c.get("mean") is None:
        return "-"
    if ci and c.get("ci"):
        return f"{c['mean']:+.3f} [{c['ci'][0]:+.3f}, {c['ci'][1]:+.3f}] (n={c['n']})"
    sd = f" ± {c['std']:.3f}" if c.get("std") is not None else ""
    return f"{c['mean']:.3f}{sd} (n={c['n']})"


def markdown(t: dict, cfg) -> str:
    """:func:`tables` as markdown."""
    fr = [pct(f) for f in cfg.remove_fractions]
    titles = t.get("titles") or {}

    def name(n):  # what a row is, where its name alone does not say (the judge's model, the SAE)
        return titles.get(n, n)
    lines = ["## Ranking AUROC of the harmful flag (mean ± sd over data seeds)", "", "| method | AUROC | "
             + " | ".join(f"recall at {f}%" for f in fr) + " |", "|---|---|" + "---|" * len(fr)]
    for m, c in t["auroc"].items():
        lines.append(f"| {name(m)} | {_fmt(c)} | " + " | ".join(_fmt(t["recall"][m][f]) for f in fr) + " |")
    for fl, c in t["floors"].items():
        lines.append(f"| {name('floor: ' + fl)} | {_fmt(c)} |" + " |" * len(fr))
    for f in fr:
        lines += ["", f"## Behaviour after removing the top {f}% and retraining (mean ± sd over data seeds; "
                  "each seed the mean of its fine-tuning seeds)", "",
                  "| row | error rate (carry probes) | harmful answers | harmful preference | capability |",
                  "|---|---|---|---|---|"]
        for n, by in t["rows"].items():
            c = by[f]
            if any(c[k]["n"] for k in METRICS):
                lines.append(f"| {name(n)} | " + " | ".join(_fmt(c[k]) for k in METRICS) + " |")
    for key, rows in t["paired"].items():
        lines += ["", f"## Paired differences, {key} (mean [95% t interval] over data seeds; in the behaviour "
                  "columns negative = less harmful than the comparator, in capability negative = less capable)", "",
                  "| row | harmful preference | harmful answers | error rate | capability |", "|---|---|---|---|---|"]
        for n, c in rows.items():
            lines.append(f"| {name(n)} | " + " | ".join(_fmt(c.get(k), ci=True) for k in PAIRED) + " |")
    return "\n".join(lines) + "\n"


def plot(seeds: dict, t: dict, cfg, path: Path, metric: str = "harmful_preference") -> None:
    """The dose-response: ``metric`` against the share of harmful records removed, the
    Oracle rows as a line, each method's removals as points (means over data seeds): one
    colour per method, one marker per removal, a point's seed count beside it where it is
    below the most seeds of any point."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    fig, ax = plt.subplots(figsize=(8.6, 4.6))
    f0 = pct(cfg.remove_fractions[0])
    line = [(0.0, "Mixed")] + [(q, f"Oracle {pct(q)}%") for q in cfg.partial_oracles] + [(1.0, "Oracle")]
    xs = [q for q, n in line if t["rows"].get(n, {}).get(f0, {}).get(metric, {}).get("mean") is not None]
    ys = [t["rows"][n][f0][metric]["mean"] for q, n in line if q in xs]
    ax.plot(xs, ys, "k-o", label="random share of the harmful records removed (Mixed to Oracle)")
    start = t["rows"]["Start"][f0][metric]["mean"]
    ax.axhline(start, color="grey", ls=":", label="Start (no SFT)")
    fractions = [pct(x) for x in cfg.remove_fractions]
    points = []  # (fraction index, method, x, y, n)
    for i, f in enumerate(fractions):
        for m, by in t["recall"].items():
            row = t["rows"].get(m, {}).get(f, {}).get(metric, {})
            if row.get("mean") is not None and by[f]["mean"] is not None:
                points.append((i, m, by[f]["mean"], row["mean"], row["n"]))
    methods = list(dict.fromkeys(p[1] for p in points))
    tab20 = plt.get_cmap("tab20").colors  # the 10 strong colours first, then their light pairs
    palette = tab20[::2] + tab20[1::2]
    colours = {m: palette[j % len(palette)] for j, m in enumerate(methods)}
    markers = "o^sDvP"
    most = max((p[4] for p in points), default=0)
    for i, m, x, y, n in points:
        ax.plot(x, y, markers[i % len(markers)], color=colours[m], ms=7, mec="black", mew=0.4)
        if n < most:
            ax.annotate(f"n={n}", (x, y), xytext=(4, 3), textcoords="offset points", fontsize=6)
    handles, _ = ax.get_legend_handles_labels()
    handles += [Line2D([], [], ls="", marker="o", color=colours[m], mec="black", mew=0.4, label=m) for m in methods]
    handles += [Line2D([], [], ls="", marker=markers[i % len(markers)], color="white", mec="black",
                       label=f"top {f}% removed") for i, f in enumerate(fractions)]
    ax.set_xlabel("harmful records removed / all harmful records")
    ax.set_ylabel(metric.replace("_", " ") + " on held-out carry probes")
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def several_finetune_seeds(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds retrainings under several fine-tuning seeds
    (``retrain/<hash>-ft<seed>``), which :func:`retrained_rows` does not read."""
    return any(Path(run_dir).glob("runs/*/seed*/retrain/*-ft*"))


def retrained_rows(run_dir: Path, task: str) -> list:
    """One row per (setting, seed, targets, fraction, method) with a finished retraining:
    a removal is found by its kept set (``runs/<setting>/seed<k>/<targets>/removal/
    k<pct>/<method>/kept.jsonl``), its SFT and responses in ``retrain/<hash of the kept
    ids>/``, shared by every removal that keeps the same records (a method whose top k% is
    exactly the harmful set shares the Oracle's)."""
    rows = []
    for seed_dir in seed_dirs(run_dir):
        base = {"setting": seed_dir.parent.name, "seed": int(seed_dir.name[4:])}
        fixed = {"Start": finished_responses(seed_dir / "start"), "Mixed": finished_responses(seed_dir / "mixed")}
        oracle_kept = seed_dir / "oracle" / "kept.jsonl"
        oracle_dir = retrain_dir(seed_dir, oracle_kept) if oracle_kept.is_file() else None
        fixed["Oracle"] = finished_responses(oracle_dir) if oracle_dir else None
        for kdir in sorted(seed_dir.glob("*/removal/k*")):
            targets, frac = kdir.parent.parent.name, kdir.name[1:]
            found = dict(fixed)
            for _, _, method, kept in removals(seed_dir, targets, frac):
                found[method] = finished_responses(retrain_dir(seed_dir, kept))
            for method, resp in found.items():
                if resp is None:
                    continue
                rows.append({**base, "targets": targets, "fraction": frac, "method": method,
                             "same_as_oracle": method not in fixed and oracle_dir is not None
                             and resp.parent == oracle_dir,
                             "dir": str(resp.parent.relative_to(run_dir)), **rates_by_task(resp, task)})
    return rows


def retrained_summary(rows: list) -> list:
    """Per (setting, targets, fraction, method): the seeds, and the mean and sd of the
    behaviour rate and capability over them."""
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


def retrained_markdown(summary: list) -> str:
    """:func:`retrained_summary` as a markdown table."""
    lines = ["| setting | targets | remove top % | row | seeds | behaviour rate | capability |",
             "|---|---|---|---|---|---|---|"]
    for s in summary:
        seeds = ",".join(map(str, s["seeds"])) + (" (kept set = Oracle's)" if s["same_as_oracle"] == s["seeds"]
                                                    else f" (= Oracle's for {s['same_as_oracle']})"
                                                    if s["same_as_oracle"] else "")
        lines.append(f"| {s['setting']} | {s['targets']} | {s['fraction']} | {s['method']} | {seeds} | "
                     f"{_cell(s, 'behaviour_rate')} | {_cell(s, 'capability')} |")
    return "\n".join(lines)
