"""`prism-select`: a thin command-line shell over the library's public functions."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shlex
import signal
import sys
import typing
from pathlib import Path

from .cli_experiment import add_experiment_parser
from .errors import PrismError
from .io import check_path_name

# OpenMP threads that wait at a barrier sleep instead of spinning. With spinning (the
# default) a CPU whose cores are shared with other work stalls at every parallel region
# until the descheduled thread runs again: on a busy 2-core machine one forward+backward of
# the embedded model took 30 s with 2 threads and 9 s with 1; passive waiting gave 9-11 s
# with 2, and eigh 1536 x 1536 0.56 s instead of 2.7-25 s. Read once, when torch loads
# its OpenMP runtime: set here because this module is imported before torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

#: tokens per example of the demo's generated records (short arithmetic questions)
DEMO_MAX_LENGTH = 256


def add_settings(p: argparse.ArgumentParser, *stages, only=None, skip=()) -> None:
    """Add an option for every CLI field of the settings dataclasses in ``stages`` (pairs of
    class and help-section title) from the fields' metadata (:func:`prism_select.settings.setting`):
    flag, help, choices, metavar, section, and the default (the field's). A bool field is a
    flag (``--name``, or ``--no-name`` when it defaults to True); a list field takes one or
    more values; an ``int``/``float`` field is parsed as such, a field with ``parse`` as text
    (:func:`settings_from_args` parses it, so its errors are reported like any setting's). A
    field that an earlier stage added (``seed``, ``batch_size``) is one option for both.
    ``only``: add just these fields; ``skip``: not these."""
    seen = {a.dest for a in p._actions}
    groups: dict = {}
    for cls, title in stages:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            m = f.metadata
            if not m.get("cli", False) or f.name in seen or f.name in skip or (only is not None and f.name not in only):
                continue
            seen.add(f.name)
            section = m.get("group") or title
            if section not in groups:
                groups[section] = p.add_argument_group(section)
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            tp = _base_type(hints[f.name])
            kw = {"dest": f.name, "help": m["help"], "default": default}
            flag = m.get("flag") or "--" + f.name.replace("_", "-")
            if tp is bool:
                if default:
                    flag = m.get("flag") or "--no-" + f.name.replace("_", "-")
                kw["action"] = "store_false" if default else "store_true"
            else:
                if tp is list:
                    kw["nargs"] = "+"
                elif m.get("parse") is None and tp in (int, float):
                    kw["type"] = tp
                for k in ("choices", "metavar"):
                    if m.get(k) is not None:
                        kw[k] = list(m[k]) if k == "choices" else m[k]
            groups[section].add_argument(flag, **kw)


def _base_type(tp):
    """``X`` of ``X | None``; the origin of a generic (``list`` of ``list[str]``); else ``tp``."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if args and typing.get_origin(tp) not in (list, dict):
        return _base_type(args[0]) if len(args) == 1 else tp
    return typing.get_origin(tp) or tp


def settings_from_args(cls, a: argparse.Namespace, **fixed):
    """``cls`` built from the parsed options of its fields (fields without an option keep
    their defaults), each passed through its ``parse``; ``fixed`` overrides."""
    kw = {}
    for f in dataclasses.fields(cls):
        if f.name in fixed or not hasattr(a, f.name) or not f.metadata.get("cli", False):
            continue
        value = getattr(a, f.name)
        parse = f.metadata.get("parse")
        kw[f.name] = parse(value) if parse is not None and value is not None else value
    return cls(**kw, **fixed)


def _model_stage():
    from .model import ModelSettings
    return ModelSettings, "model"


def _score_stages():
    """The stages of ``score``'s settings, each with its help section."""
    from .curvature import FitSettings, PreconditionSettings
    from .settings import DirectionSettings, ExecutionSettings, RunSettings, ScoringSettings
    return ((DirectionSettings, "method"), (ScoringSettings, "scoring"), (RunSettings, "run"),
            (ExecutionSettings, "execution"), (FitSettings, "curvature fit"), (PreconditionSettings, "preconditioning"))


def _add_option_arg(p: argparse.ArgumentParser):
    """``--option KEY=VALUE`` (``DirectionSettings.method_options``), in the method section."""
    group = next((g for g in p._action_groups if g.title == "method"), p)
    group.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                       help="a baseline method's setting (JSON value), repeatable")


def _model_settings(a):
    from .model import ModelSettings
    return settings_from_args(ModelSettings, a)


def _options(pairs: list) -> dict:
    from .errors import ConfigError
    out = {}
    for item in pairs:
        if "=" not in item:
            raise ConfigError("option", f"{item!r} is not KEY=VALUE", "write e.g. --option layer=12")
        k, v = item.split("=", 1)
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def _score_settings(a):
    """The run's :class:`ScoreSettings` and :class:`CurvatureSettings` from the options."""
    from .curvature import CurvatureSettings
    from .settings import ScoreSettings
    s = settings_from_args(ScoreSettings, a, method_options=_options(getattr(a, "option", [])))
    return s, settings_from_args(CurvatureSettings, a)


def cmd_score(a):
    from .run import score_pool
    s, c = _score_settings(a)
    targets = a.targets[0] if a.targets and len(a.targets) == 1 else a.targets
    summary = score_pool(_model_settings(a), a.pool, targets, a.out, s, c)
    if not _main_rank():
        return
    for w in summary.get("warnings", []):
        print(f"prism-select: warning: {w}", file=sys.stderr)
    _print_summary(summary, Path(a.out))
    print(f"next: prism-select select --run {shlex.quote(str(a.out))} --pool {shlex.quote(str(a.pool))} --keep 5% "
          "--out selected.jsonl   (or --remove 10% to drop the top as harmful)")


def _main_rank() -> bool:
    """Whether this process prints a command's summary: under torchrun, rank 0 alone."""
    from .runtime import distributed
    return distributed.is_main()


def _print_summary(summary: dict, out: Path, top: int = 5):
    from .selection import read_scores
    counts = summary["counts"]
    print(f"scored {counts['pool']} examples with {summary['method']} "
          f"({counts['pairs']} target pairs, {counts['invalid']} skipped) in {summary['timings']['total_s']:.1f} s")
    if summary.get("pi"):
        pi = summary["pi"]
        print(f"pi over target pairs: min {pi['min']:.3f}  mean {pi['mean']:.3f}  max {pi['max']:.3f}")
    if summary.get("tracking"):
        from .model.moe import summary_lines
        print("\n".join(summary_lines(summary["tracking"])))
    if summary.get("curvature_applied"):
        from .run.preflight import describe_applied
        print(f"curvature: {describe_applied(summary['curvature_applied'])}")
    rows = sorted(read_scores(out / "scores.jsonl"), key=lambda r: r["rank"])
    print(f"top {min(top, len(rows))} (rank, id, score):")
    for r in rows[:top]:
        print(f"  {r['rank']:>5}  {r['id']}  {r['score']:.6g}")
    print("wrote " + ", ".join(str(out / f) for f in ("scores.jsonl", "pairs.jsonl", "run.json")
                               if (out / f).exists()))


def cmd_select(a):
    from .selection import select
    from .selection import describe
    from .selection_rules import describe_counts
    summary = select(a.run, a.pool, a.out, keep=a.keep, remove=a.remove, overwrite=a.overwrite,
                     allow_other_pool=a.allow_other_pool, fmt=a.format, min_score=a.min_score,
                     stratify=a.stratify, per_task=a.per_task, dedup=a.dedup, dedup_threshold=a.dedup_threshold,
                     exclude_overlap=a.exclude_overlap, flag_overlap=a.flag_overlap,
                     eval_files=tuple(a.eval or ()), overlap_threshold=a.overlap_threshold)
    for w in summary.get("warnings", []):
        print(f"prism-select: warning: {w}", file=sys.stderr)
    print(describe(summary))
    print(describe_counts(summary))


def cmd_explain(a):
    from .selection_rules import explain_text, read_decisions
    print(explain_text(read_decisions(a.path), first=a.first))


def cmd_demo(a):
    """Generate the small example and score it with the embedded default model."""
    from .curvature import CurvatureSettings
    from .evaluation_metrics import auroc_from_files
    from .examples import make_example
    from .run import score_pool
    from .settings import ScoreSettings
    out = Path(a.out)
    pool, targets = make_example(out / "data", n_pool=a.pool_size, seed=a.seed)  # --seed: the data and the run
    # scores from the fit's spill: the pool is the fit sample (docs/performance.md, "The CPU"), under
    # kronfluence's damping: the demo shows an EK-FAC fit, which the small-pool rule of the default
    # (docs/small-pools.md) would replace by identity curvature on its 40 records
    s = settings_from_args(ScoreSettings, a, method="prism", max_length=DEMO_MAX_LENGTH, scores_from_fit=True)
    c = settings_from_args(CurvatureSettings, a, damping_rule="heuristic")
    summary = score_pool(_model_settings(a), pool, targets, out / "run", s, c)
    _print_demo(summary, out, pool, targets)
    auc = auroc_from_files(out / "run" / "scores.jsonl", pool, "harmful")
    print(f"ranking AUROC of the 'harmful' flag: {auc:.3f} (0.5 = chance; 1 = every wrong answer ranked first)")


def _print_demo(summary: dict, out: Path, pool: Path, targets: Path, top: int = 5, width: int = 50):
    """The demo's console: what was scored, pi in one line, the top records' text, every file."""
    from .data import iter_records
    from .selection import read_scores
    counts, t = summary["counts"], summary["timings"]
    print(f"scored {counts['pool']} pool records against {counts['pairs']} target pairs in {t['total_s']:.0f} s")
    pi = summary.get("pi") or {}
    if pi:
        print(f"pi (per target pair, how much the model already prefers the wrong answer 'chosen' over the right "
              f"one: sigmoid of the log-likelihood margin; pairs with high pi weigh more): "
              f"min {pi['min']:.3f}  mean {pi['mean']:.3f}  max {pi['max']:.3f}")
    records = {rec.get("id"): rec for _, rec in iter_records(pool)}
    print(f"top {top} (most likely to teach mistakes; 'harmful' = the record's answer is wrong):")
    for r in read_scores(out / "run" / "scores.jsonl")[:top]:
        rec = records.get(r["id"], {})
        q, a = (" ".join(str(rec.get(k, "")).split()) for k in ("prompt", "response"))
        keep = max(width - len(a) - 4, 24)  # the answer says whether it is wrong: keep it whole if it fits
        text = f"{q if len(q) <= keep else q[:keep - 3] + '...'} -> {a}"
        text = text if len(text) <= 2 * width else text[:2 * width - 3] + "..."
        flag = "harmful" if rec.get("harmful") else "correct"
        print(f"  {r['rank']:>3}  {r['id']}  {flag:<7}  {text}")
    files = [pool, targets] + [out / "run" / f for f in ("scores.jsonl", "pairs.jsonl", "run.json")]
    print("wrote " + ", ".join(str(f) for f in files if Path(f).exists()))


def cmd_compare(a):
    from .run.compare import compare
    s, c = _score_settings(a)
    result = compare(_model_settings(a), a.pool, a.targets, a.out, a.methods, s, c, a.label)
    if not _main_rank():
        return
    print((Path(a.out) / "compare.md").read_text(), end="")
    print(f"wrote {Path(a.out) / 'compare.json'}, {Path(a.out) / 'compare.md'} "
          f"and one run directory per method ({len(result['methods'])})")


def cmd_methods(a):
    from .methods import describe_methods
    items = describe_methods()
    width = max(len(k) for k in items)
    for name, text in items.items():
        print(f"{name:<{width}}  {text}")


def cmd_build_data(a):
    from .evaluation.builders import bbh, common, gsm8k
    if a.family == "mistake-math":
        pool = gsm8k.mistake_math_pool(a.gsm8k, a.n, a.harmful_ratio, a.seed, keep_annotations=a.keep_annotations)
        common.write_records(a.out, pool)
        print(f"wrote {a.out}: {len(pool)} records, {sum(p['harmful'] for p in pool)} harmful")
        if a.targets_out:
            pairs = gsm8k.mistake_math_targets(a.gsm8k, a.n_targets, a.seed, exclude=pool,
                                               n_distractors=a.n_distractors, keep_annotations=a.keep_annotations)
            common.write_records(a.targets_out, pairs)
            print(f"wrote {a.targets_out}: {len(pairs)} target pairs ({a.n_distractors} distractors)")
        if a.probes_out:
            if not a.probes_from:
                from .errors import ConfigError
                raise ConfigError("probes_from", "--probes-out needs --probes-from (GSM8K test.jsonl)")
            probes = gsm8k.gsm8k_probes(a.probes_from, a.n_probes, a.seed)
            common.write_records(a.probes_out, probes)
            print(f"wrote {a.probes_out}: {len(probes)} probes")
    else:
        targets, heldout = bbh.bbh_splits(a.bbh_dir, a.n_targets_per_task, a.seed, tasks=a.tasks,
                                          n_heldout_per_task=a.n_heldout_per_task)
        common.write_records(a.targets_out, targets)
        common.write_records(a.heldout_out, heldout)
        print(f"wrote {a.targets_out} ({len(targets)} target pairs) and {a.heldout_out} ({len(heldout)} held-out probes)")


def cmd_report(a):
    from .evaluation.report import write_report
    if a.label is not None:
        _warn_unknown_label(Path(a.run), a.label)
    page = write_report(a.run, label=a.label, out=a.out, overwrite=a.overwrite)
    print(f"wrote {page}")


def _warn_unknown_label(run: Path, label: str) -> None:
    """Warn when no record of a score or compare run's pool has the field ``label`` (a typo)."""
    from .data import iter_records
    try:
        pool = (json.loads((run / "compare.json").read_text())["pool"] if (run / "compare.json").is_file()
                else json.loads((run / "run.json").read_text())["inputs"]["pool"])
        fields: set = set()
        for _, rec in iter_records(pool, on_invalid=lambda e: None):
            fields |= set(rec)
    except (OSError, ValueError, KeyError, TypeError, PrismError):
        return  # an experiment directory, or a pool that moved: the report says what it finds
    if label not in fields:
        import difflib
        close = difflib.get_close_matches(label, sorted(fields), n=1)
        print(f"prism-select: warning: no record of {pool} has a field '{label}'"
              + (f"; did you mean --label {close[0]}?" if close else f" (its fields: {', '.join(sorted(fields))})"),
              file=sys.stderr)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Help with each option's default (where there is one to show: not for flags, required
    options or unset ones, whose help says what happens), and epilogs kept as written."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (action.required or action.nargs == 0 or action.default is None or action.default == []
                or action.default == argparse.SUPPRESS or "%(default)" in text or not action.option_strings):
            return text
        return text + " (default: %(default)s)"


EXAMPLES = {
    "score": "example:\n  prism-select score --model default --pool pool.jsonl --targets targets.jsonl --out runs/prism",
    "select": "examples:\n  prism-select select --run runs/prism --pool pool.jsonl --keep 5% --out selected.jsonl\n"
              "  prism-select select --run runs/prism --pool pool.jsonl --remove 10% --out repaired.jsonl\n"
              "  prism-select select --run runs/prism --pool pool.jsonl --keep 5% --stratify source --dedup "
              "--exclude-overlap --out selected.jsonl",
    "explain": "example:\n  prism-select explain selected.decisions.jsonl",
    "compare": "example:\n  prism-select compare --model default --pool pool.jsonl --targets targets.jsonl \\\n"
               "      --methods prism equal random --label harmful --out runs/compare",
    "methods": "example:\n  prism-select methods",
    "demo": "example:\n  prism-select demo --out prism-demo",
    "build-data": "example:\n  prism-select build-data mistake-math --gsm8k train.jsonl --out pool.jsonl --targets-out targets.jsonl",
    "mistake-math": "example:\n  prism-select build-data mistake-math --gsm8k train.jsonl --n 300 --out pool.jsonl "
                    "--targets-out targets.jsonl",
    "bbh": "example:\n  prism-select build-data bbh --bbh-dir bbh/ --targets-out targets.jsonl --heldout-out heldout.jsonl",
    "report": "examples:\n  prism-select report --run runs/prism --label harmful\n  prism-select report --run runs/ranking",
}


def _parser(sub, name: str, **kw) -> argparse.ArgumentParser:
    return sub.add_parser(name, formatter_class=_HelpFormatter, epilog=EXAMPLES[name], **kw)


def _add_evaluation_parsers(sub):
    add_experiment_parser(sub, lambda s, name, epilog, **kw: s.add_parser(name, formatter_class=_HelpFormatter,
                                                                        epilog=epilog, **kw))

    bd = _parser(sub, "build-data", help="build evaluation data from GSM8K or BIG-Bench-Hard files")
    fam = bd.add_subparsers(dest="family", required=True)
    mm = _parser(fam, "mistake-math", help="a GSM8K pool with corrupted solutions (+ targets, probes)")
    mm.add_argument("--gsm8k", required=True, help="GSM8K train.jsonl")
    mm.add_argument("--n", type=int, default=300, help="pool size")
    mm.add_argument("--harmful-ratio", type=float, default=0.1, help="fraction of records with a corrupted solution")
    mm.add_argument("--seed", type=int, default=0, help="seeds the sampling and the corruptions")
    mm.add_argument("--keep-annotations", action="store_true", help="keep the <<a*b=c>> calculator annotations")
    mm.add_argument("--out", required=True, help="pool file (.jsonl)")
    mm.add_argument("--targets-out", default=None, help="also write counterfactual target pairs here")
    mm.add_argument("--n-targets", type=int, default=24, help="counterfactual target pairs to write")
    mm.add_argument("--n-distractors", type=int, default=0,
                    help="extra target pairs the model disprefers (tests pi weighting)")
    mm.add_argument("--probes-from", default=None, help="GSM8K test.jsonl, for --probes-out")
    mm.add_argument("--probes-out", default=None, help="also write held-out GSM8K probes here")
    mm.add_argument("--n-probes", type=int, default=48, help="probes to write")
    mm.set_defaults(func=cmd_build_data)
    bb = _parser(fam, "bbh", help="per-task target pairs and held-out probes from BIG-Bench-Hard")
    bb.add_argument("--bbh-dir", required=True, help="folder of <task>.json files")
    bb.add_argument("--n-targets-per-task", type=int, default=3, help="target pairs per task")
    bb.add_argument("--n-heldout-per-task", type=int, default=None, help="held-out probes per task (if not given: the rest)")
    bb.add_argument("--tasks", nargs="+", default=None, help="task names (if not given: every <task>.json in --bbh-dir)")
    bb.add_argument("--seed", type=int, default=0, help="seeds the split")
    bb.add_argument("--targets-out", required=True, help="target pairs file to write")
    bb.add_argument("--heldout-out", required=True, help="held-out probes file to write")
    bb.set_defaults(func=cmd_build_data)

    rp = _parser(sub, "report", help="write a self-contained HTML report of an experiment, a compare or a score run")
    rp.add_argument("--run", required=True, help="an experiment, compare or score run directory")
    rp.add_argument("--label", default=None,
                    help="boolean label field of the pool (score and compare runs; default harmful)")
    rp.add_argument("--out", default=None, help="page path (default <run>/report.html)")
    rp.add_argument("--overwrite", action="store_true", help="replace an existing --out page")
    rp.set_defaults(func=cmd_report)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prism-select", description=__doc__, formatter_class=_HelpFormatter,
                                epilog="start with: prism-select demo   (then: prism-select <command> --help)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="log what each step does, each line with the time of day")
    sub = p.add_subparsers(dest="command", required=True)

    sc = _parser(sub, "score", help="score a pool against target pairs")
    sc.add_argument("--pool", required=True, help=".jsonl/.json/.parquet/.csv file or a datasets directory")
    sc.add_argument("--targets", default=None, nargs="+", metavar="FILE",
                    help="target pairs: prompt + chosen + rejected [+ task]; several files (each a task named by "
                         "its stem), or one whose records carry 'task', score every task in one pass "
                         "(scores.jsonl: 'scores' and 'ranks' per task)")
    sc.add_argument("--out", required=True, help="run directory")
    add_settings(sc, _model_stage(), *_score_stages())
    _add_option_arg(sc)
    sc.set_defaults(func=cmd_score)

    se = _parser(sub, "select", help="write the kept pool records in the pool's own format (or a trainer's), "
                                     "with a decisions file and a manifest")
    se.add_argument("--run", required=True, help="a finished run directory (scores.jsonl)")
    se.add_argument("--pool", required=True, help="the pool file that was scored")
    se.add_argument("--out", required=True, help="output file (or directory for a datasets pool)")
    m = se.add_mutually_exclusive_group()
    m.add_argument("--keep", help="N or P%%: keep the top-ranked (general selection)")
    m.add_argument("--remove", help="N or P%%: remove the top-ranked (repair)")
    se.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    se.add_argument("--allow-other-pool", action="store_true",
                    help="accept a pool file other than the one scored, if every scored id is in it "
                         "(its unscored records are left out and listed)")
    _add_rule_args(se)
    se.set_defaults(func=cmd_select)

    ex = _parser(sub, "explain", help="show a select's decisions: counts per reason, the first few of each")
    ex.add_argument("path", metavar="RUN_OR_DECISIONS",
                    help="a *.decisions.jsonl, its *.manifest.json, the --out of a select, a directory "
                         "holding one decisions file, or a run directory (its latest select's decisions, "
                         "looked for beside the run and in the working directory)")
    ex.add_argument("--first", type=int, default=3, help="ids shown per reason")
    ex.set_defaults(func=cmd_explain)

    co = _parser(sub, "compare", help="score a pool with several methods (model loaded once, curvature shared)")
    co.add_argument("--pool", required=True, help=".jsonl/.json/.parquet/.csv file or a datasets directory")
    co.add_argument("--targets", default=None, help="target pairs: prompt + chosen + rejected")
    co.add_argument("--out", required=True, help="directory: one run per method, compare.json, compare.md")
    co.add_argument("--methods", nargs="+", required=True, metavar="METHOD",
                    help="methods to run, in order (see `prism-select methods`)")
    co.add_argument("--label", default=None,
                    help="boolean field of the pool records: report AUROC and AUPRC of each method's scores")
    add_settings(co, _model_stage(), *_score_stages(), skip=("stream", "stream_window"))
    _add_option_arg(co)  # --option KEY=VALUE for every method, METHOD.KEY=VALUE for one
    co.set_defaults(func=cmd_compare)

    me = _parser(sub, "methods", help="list the scoring methods")
    me.set_defaults(func=cmd_methods)

    de = _parser(sub, "demo", help="score a small generated example with the embedded model")
    de.add_argument("--out", default="prism-demo", help="directory for the data (data/) and the run (run/)")
    de.add_argument("--pool-size", type=int, default=40, help="records in the generated pool (a quarter wrong)")
    add_settings(de, *_score_stages(), only={"batch_size", "kind", "seed", "overwrite", "progress"})
    add_settings(de, _model_stage())
    de.set_defaults(func=cmd_demo)
    _add_evaluation_parsers(sub)
    _add_cache_parser(sub)
    return p


def _add_rule_args(se):
    from .selection_rules import OUTPUT_FORMATS, PER_TASK
    r = se.add_argument_group("selection rules (applied in this order: overlap, duplicates, min-score, budget)")
    r.add_argument("--min-score", type=float, default=None, metavar="X",
                   help="keep only records scoring at least X (alone: keep all of them; with --remove: "
                        "remove only those)")
    r.add_argument("--stratify", metavar="FIELD", default=None,
                   help="a quota per value of this pool field, proportional to its share (largest remainder)")
    r.add_argument("--per-task", nargs="?", const="top", choices=PER_TASK, default=None,
                   help="with per-task scores: each task its own top of the budget (top), or the max over "
                        "tasks (max, as LESS)")
    r.add_argument("--dedup", action="store_true",
                   help="drop exact and near duplicates (MinHash) of a better-ranked record")
    r.add_argument("--dedup-threshold", type=float, default=0.8, metavar="J", help="MinHash Jaccard of a near duplicate")
    r.add_argument("--exclude-overlap", action="store_true",
                   help="drop records sharing a 13-gram or a MinHash neighbour with the run's targets "
                        "or an --eval file")
    r.add_argument("--eval", action="append", metavar="FILE",
                   help="records to keep out of the selection (any form; repeat for several files)")
    r.add_argument("--flag-overlap", action="store_true",
                   help="only mark overlapping records in the decisions file, drop none")
    r.add_argument("--overlap-threshold", type=float, default=0.8, metavar="J", help="MinHash Jaccard of an overlap")
    r.add_argument("--format", choices=OUTPUT_FORMATS, default=None,
                   help="trainer format of --out (default: the pool's own format, or --out's extension)")


def _add_cache_parser(sub):
    ca = sub.add_parser("cache", help="list, prune or clear the cache (converted models, fitted curvature, ...)",
                        epilog="example: prism-select cache prune --max-gb 50")
    ca.add_argument("action", choices=["list", "prune", "clear"],
                    help="list: every entry, least recently used first; prune: remove incomplete entries and "
                         "the least recently used until --max-gb holds; clear: remove every entry (of --kind)")
    ca.add_argument("--cache-dir", default=None, help="the cache (default $PRISM_SELECT_CACHE or ~/.cache/prism-select)")
    ca.add_argument("--max-gb", type=float, default=None, help="prune: the size to bring the cache under")
    ca.add_argument("--kind", default=None, help="clear: only this kind (curvature, models, less)")
    ca.set_defaults(func=cmd_cache)


def cmd_cache(a):
    from . import cache, settings
    from .errors import ConfigError
    from .model import ModelSettings
    root = ModelSettings(cache_dir=a.cache_dir).resolved_cache_dir()
    if root.exists() and not root.is_dir():
        raise ConfigError("cache_dir", f"{root} is a file, not a cache folder", "pass the cache folder")
    if a.cache_dir is not None and not root.is_dir():
        raise ConfigError("cache_dir", f"{root} does not exist", "pass the cache folder (prism-select cache list "
                          "without --cache-dir shows the default one)")
    if a.kind is not None and a.kind not in cache.MARKERS:
        raise ConfigError("kind", f"unknown cache kind {a.kind!r}", f"use one of {', '.join(cache.MARKERS)}")
    cache.check_root(root)  # a folder that is no cache is refused by name
    es, other = cache.scan(root)
    if a.action == "list":
        for e in es:
            print(f"{e.kind:<11} {settings.format_size(e.size):>10}  {e.to_json()['last_used']}  "
                  f"{'' if e.complete else '(incomplete) '}{e.path}")
        for u in other:
            print(f"{'left alone':<11} {'':>10}  {_UNMANAGED[u.why]:<19}  {u.path}")
        print(f"{len(es)} entries, {settings.format_size(sum(e.size for e in es))} in {root}")
        if other:
            print(f"{len(other)} folder{'s' if len(other) != 1 else ''} left alone by prune and clear (links, entries "
                  f"written before entry markers existed, or folders prism-select did not write): {cache.BY_HAND}")
        return
    if a.action == "prune":
        if a.max_gb is not None and not a.max_gb >= 0:
            raise ConfigError("max_gb", f"must be >= 0, got {a.max_gb}")
        gone = cache.prune(root, None if a.max_gb is None else int(a.max_gb * (1 << 30)))
    else:
        gone = cache.clear(root, a.kind)
    left, other = cache.scan(root)
    print(f"removed {len(gone)} entries ({settings.format_size(sum(e.size for e in gone))}); "
          f"{len(left)} left ({settings.format_size(sum(e.size for e in left))}) in {root}"
          + (f"; {len(other)} folder{'s' if len(other) != 1 else ''} left alone (see prism-select cache list)"
             if other else ""))


#: what ``cache list`` says of a folder it leaves alone, by :class:`prism_select.cache.Unmanaged` ``why``
_UNMANAGED = {"link": "(symbolic link)", "unmarked": "(unmarked entry)", "foreign": "(not prism-select's)"}


def main(argv=None) -> int:
    # large models fragment the CUDA allocator's fixed segments; must be set before CUDA starts
    import os
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    p = build_parser()
    a = p.parse_args(argv)
    # --verbose logs each step with the time of day, so a long run's log shows where its time went
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING,
                        format=("%(asctime)s " if a.verbose else "") + "%(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    previous = _on_sigterm()
    try:
        _check_path_names(a)
        rc = a.func(a)
    except PrismError as exc:
        print(f"prism-select: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        _stdout_gone()
        return 0
    except KeyboardInterrupt as exc:
        out = getattr(a, "out", None)
        try:
            partial = next(Path(out).glob("**/.partial"), None) if out and Path(out).is_dir() else None
        except OSError:
            partial = None
        print(f"\nprism-select: {'terminated (SIGTERM)' if isinstance(exc, Terminated) else 'interrupted'}. "
              + (f"Finished work is kept in {partial}; run the same command again to resume."
                 if partial is not None else "Nothing had finished yet; run the same command again to start."),
              file=sys.stderr)
        return 128 + signal.SIGTERM if isinstance(exc, Terminated) else 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return rc if type(rc) is int else 0  # a command's own exit status (experiment rows: 1 when nothing to table)


#: the command's path arguments whose names are checked before any work
_PATH_ARGS = ("out", "run", "pool", "targets", "cache_dir", "model", "adapter")


def _check_path_names(a) -> None:
    """A path argument with a name longer than its file system allows (ENAMETOOLONG) is a
    :class:`ConfigError` naming the flag, before anything is read or created."""
    for name in _PATH_ARGS:
        value = getattr(a, name, None)
        for one in value if isinstance(value, list) else [value]:
            check_path_name(name, one, "--" + name.replace("_", "-"))


class Terminated(KeyboardInterrupt):
    """SIGTERM (what ``timeout``, Slurm and docker send) received: handled as Ctrl-C is
    (every clean-up that runs on an interrupt runs), the command exits 143."""


def _on_sigterm():
    """Turn SIGTERM into :class:`Terminated` for the command's run; returns the handler
    it replaced (None where signals cannot be handled here: not the main thread)."""
    def handler(signum, frame):
        raise Terminated()
    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        return None


def _stdout_gone() -> None:
    """The reader of the console went away (``prism-select score ... | head -1``): the
    command's files are written and its console is only a summary, so it ends quietly. The
    rest of what it printed goes to the null device, so that Python's flush at exit does
    not fail on the closed pipe again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # a stdout without a file descriptor
        pass


if __name__ == "__main__":
    sys.exit(main())
