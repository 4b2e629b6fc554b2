"""`prism-select`: a thin command-line shell over the library's public functions."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from .errors import PrismError


def _add_model_args(p: argparse.ArgumentParser):
    g = p.add_argument_group("model")
    g.add_argument("--model", default="default",
                   help="local Hugging Face directory, a .gguf file, or 'default' (embedded SmolLM2-135M-Instruct)")
    g.add_argument("--adapter", default=None, help="PEFT adapter directory (its LoRA matrices are tracked)")
    g.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float64"])
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="allow the model directory's own Python code (off by default)")
    g.add_argument("--cache-dir", default=None, help="cache for converted models and curvature "
                   "(default $PRISM_SELECT_CACHE or ~/.cache/prism-select)")


def _add_score_args(p: argparse.ArgumentParser):
    from .curvature.base import DEFAULT_DAMPING_FACTOR, KINDS
    from .data.tokenize import DEFAULT_MAX_LENGTH
    from .scoring import DEFAULT_CHUNK_SIZE

    g = p.add_argument_group("scoring")
    g.add_argument("--method", default="prism",
                   help="prism (default), equal, unpaired, or a baseline (see `prism-select methods`)")
    g.add_argument("--max-length", type=int, default=DEFAULT_MAX_LENGTH)
    g.add_argument("--batch-size", type=int, default=8)
    g.add_argument("--modules", nargs="+", default=None, metavar="REGEX",
                   help="track only linear layers whose name matches one of these regexes")
    g.add_argument("--skip-invalid", action="store_true", help="skip malformed records (listed in run.json)")
    g.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE, help="examples per resumable chunk")
    g.add_argument("--overwrite", action="store_true", help="replace an existing run in --out")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--no-progress", action="store_true")
    g.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a baseline method's setting (JSON value), repeatable")
    g.add_argument("--scoring", default="exact", choices=["exact", "fast", "fd32"],
                   help="exact (default): forward + activation backward in the model's dtype; fast: central "
                        "finite differences along v in the model's dtype (fastest; agrees with exact only "
                        "along directions of moderate curvature, self-checked); fd32: finite differences on "
                        "a float32 copy of a half-precision model (float32-accurate scores, slower)")
    g.add_argument("--fd-eps", type=float, default=None, metavar="EPS",
                   help="relative finite-difference step (default 0.03 for fast, 1e-5 for fd32)")
    g.add_argument("--cuda-graphs", default="auto", choices=["auto", "on", "off"],
                   help="capture each padded batch shape once and replay it (auto: on for CUDA devices and "
                        "models below 1B parameters)")
    g.add_argument("--precision", default="model", choices=["model", "residual32", "split32"],
                   help="arithmetic of a bf16/fp16 model while scoring: model (as loaded); residual32 (residual "
                        "stream in float32, matmuls unchanged); split32 (float32 activations, each linear layer as "
                        "two half-precision GEMMs on a hi/lo split: float32-accurate scores on tensor cores; the "
                        "target direction and the curvature fit run in the same arithmetic)")
    c = p.add_argument_group("curvature")
    c.add_argument("--curvature", default="ekfac", choices=list(KINDS))
    c.add_argument("--damping", type=float, default=None,
                   help=f"explicit damping; default {DEFAULT_DAMPING_FACTOR} x mean eigenvalue per layer")
    c.add_argument("--fisher", default="empirical", choices=["empirical", "sampled"])
    c.add_argument("--fit-examples", type=int, default=None, help="fit on a seeded sample of N pool examples")


def _add_stream_args(p: argparse.ArgumentParser):
    from .pipeline import DEFAULT_STREAM_WINDOW, STREAM_FIT_EXAMPLES

    g = p.add_argument_group("streaming (pools too large to load)")
    g.add_argument("--stream", action="store_true",
                   help="read and score the pool a window at a time (host memory flat in pool size; "
                        f"prism, equal, unpaired only); the curvature is fitted on a seeded sample of "
                        f"--fit-examples valid records (default {STREAM_FIT_EXAMPLES})")
    g.add_argument("--stream-window", type=int, default=None, metavar="N",
                   help=f"records read and tokenised at a time under --stream (default {DEFAULT_STREAM_WINDOW})")


def _model_settings(a):
    from .model import ModelSettings
    return ModelSettings(model=a.model, adapter=a.adapter, dtype=a.dtype, device=a.device,
                         trust_remote_code=a.trust_remote_code, cache_dir=a.cache_dir)


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
    from .curvature import CurvatureSettings
    from .pipeline import ScoreSettings
    s = ScoreSettings(method=a.method, max_length=a.max_length, batch_size=a.batch_size, modules=a.modules,
                      skip_invalid=a.skip_invalid, chunk_size=a.chunk_size, overwrite=a.overwrite,
                      progress=not a.no_progress, seed=a.seed, method_options=_options(a.option),
                      scoring=getattr(a, "scoring", "exact"), stream=getattr(a, "stream", False),
                      cuda_graphs=getattr(a, "cuda_graphs", "auto"),
                      precision=getattr(a, "precision", "model"),
                      **({"fd_eps": a.fd_eps} if getattr(a, "fd_eps", None) is not None else {}),
                      **({"stream_window": a.stream_window} if getattr(a, "stream_window", None) is not None else {}))
    c = CurvatureSettings(kind=a.curvature, damping=a.damping, fisher=a.fisher, fit_examples=a.fit_examples,
                          batch_size=a.batch_size, seed=a.seed)
    return s, c


def cmd_score(a):
    from .pipeline import score_pool
    s, c = _score_settings(a)
    summary = score_pool(_model_settings(a), a.pool, a.targets, a.out, s, c)
    _print_summary(summary, Path(a.out))


def _print_summary(summary: dict, out: Path, top: int = 5):
    from .selection import read_scores
    counts = summary["counts"]
    print(f"scored {counts['pool']} examples with {summary['method']} "
          f"({counts['pairs']} target pairs, {counts['invalid']} skipped) in {summary['timings']['total_s']:.1f} s")
    if summary.get("pi"):
        pi = summary["pi"]
        print(f"pi over target pairs: min {pi['min']:.3f}  mean {pi['mean']:.3f}  max {pi['max']:.3f}")
    rows = sorted(read_scores(out / "scores.jsonl"), key=lambda r: r["rank"])
    print(f"top {min(top, len(rows))} (rank, id, score):")
    for r in rows[:top]:
        print(f"  {r['rank']:>5}  {r['id']}  {r['score']:.6g}")
    print(f"wrote {out / 'scores.jsonl'}, {out / 'run.json'}")


def cmd_select(a):
    from .selection import select
    from .selection import describe
    summary = select(a.run, a.pool, a.out, keep=a.keep, remove=a.remove, overwrite=a.overwrite,
                     allow_other_pool=a.allow_other_pool)
    print(describe(summary))


def cmd_demo(a):
    """Generate the small example and score it with the embedded default model."""
    from .curvature import CurvatureSettings
    from .evaluation_metrics import auroc_from_files
    from .examples import make_example
    from .pipeline import ScoreSettings, score_pool
    out = Path(a.out)
    pool, targets = make_example(out / "data", n_pool=a.pool_size, seed=a.seed)
    s = ScoreSettings(method="prism", max_length=256, batch_size=a.batch_size, overwrite=a.overwrite,
                      progress=not a.no_progress, seed=a.seed)
    c = CurvatureSettings(kind=a.curvature, batch_size=a.batch_size, seed=a.seed)
    summary = score_pool(_model_settings(a), pool, targets, out / "run", s, c)
    _print_summary(summary, out / "run")
    auc = auroc_from_files(out / "run" / "scores.jsonl", pool, "harmful")
    print(f"ranking AUROC of the 'harmful' flag: {auc:.3f} (0.5 = chance; 1 = every wrong answer ranked first)")


def cmd_compare(a):
    from .baselines.compare import compare
    s, c = _score_settings(a)
    result = compare(_model_settings(a), a.pool, a.targets, a.out, a.methods, s, c, a.label)
    print((Path(a.out) / "compare.md").read_text(), end="")
    print(f"wrote {Path(a.out) / 'compare.json'}, {Path(a.out) / 'compare.md'} "
          f"and one run directory per method ({len(result['methods'])})")


def cmd_methods(a):
    from .baselines import describe_methods
    items = describe_methods()
    width = max(len(k) for k in items)
    for name, text in items.items():
        print(f"{name:<{width}}  {text}")


def cmd_experiment(a):
    from .evaluation.protocols import run_experiment
    results = run_experiment(a.protocol, a.config, a.out, seeds=a.seeds, smoke=a.smoke,
                             data_root=a.data_root, overwrite=a.overwrite)
    out = Path(a.out)
    for t in results["tables"]:
        print(t["title"])
        print("  " + " | ".join(["method"] + [str(c) for c in t["columns"]]))
        for r in t["rows"]:
            cells = ["-" if c["mean"] is None else f"{c['mean']:.3f}" + (f" +- {c['std']:.3f}" if c["std"] is not None else "")
                     for c in r["cells"]]
            print("  " + " | ".join([r["label"]] + cells))
    print(f"wrote {out / 'results.json'}" + (f" and {out / 'report.html'}" if (out / "report.html").exists() else ""))


def cmd_build_data(a):
    from .evaluation import builders as b
    if a.family == "mistake-math":
        pool = b.mistake_math_pool(a.gsm8k, a.n, a.harmful_ratio, a.seed, keep_annotations=a.keep_annotations)
        b.write_records(a.out, pool)
        print(f"wrote {a.out}: {len(pool)} records, {sum(p['harmful'] for p in pool)} harmful")
        if a.targets_out:
            pairs = b.mistake_math_targets(a.gsm8k, a.n_targets, a.seed, exclude=pool, n_distractors=a.n_distractors,
                                           keep_annotations=a.keep_annotations)
            b.write_records(a.targets_out, pairs)
            print(f"wrote {a.targets_out}: {len(pairs)} target pairs ({a.n_distractors} distractors)")
        if a.probes_out:
            if not a.probes_from:
                from .errors import ConfigError
                raise ConfigError("probes_from", "--probes-out needs --probes-from (GSM8K test.jsonl)")
            probes = b.gsm8k_probes(a.probes_from, a.n_probes, a.seed)
            b.write_records(a.probes_out, probes)
            print(f"wrote {a.probes_out}: {len(probes)} probes")
    else:
        targets, heldout = b.bbh_splits(a.bbh_dir, a.n_targets_per_task, a.seed, tasks=a.tasks,
                                        n_heldout_per_task=a.n_heldout_per_task)
        b.write_records(a.targets_out, targets)
        b.write_records(a.heldout_out, heldout)
        print(f"wrote {a.targets_out} ({len(targets)} target pairs) and {a.heldout_out} ({len(heldout)} held-out probes)")


def cmd_report(a):
    from .evaluation.report import write_report
    page = write_report(a.run, label=a.label, out=a.out)
    print(f"wrote {page}")


def _add_evaluation_parsers(sub):
    ex = sub.add_parser("experiment", help="run an evaluation protocol (ranking, repair, select) from a config")
    ex.add_argument("protocol", choices=["ranking", "repair", "select"])
    ex.add_argument("--config", required=True, help="YAML or JSON config (see prism_select.evaluation.protocols)")
    ex.add_argument("--out", required=True, help="experiment directory (rerun the same command to resume)")
    ex.add_argument("--seeds", type=int, nargs="+", default=None, help="override the config's seeds")
    ex.add_argument("--smoke", action="store_true", help="apply the config's 'smoke' section (a tiny variant)")
    ex.add_argument("--data-root", default=None, help="resolve relative data paths here "
                    "(default $PRISM_DATA_ROOT, else the config's data_root)")
    ex.add_argument("--overwrite", action="store_true", help="replace an experiment with another config in --out")
    ex.set_defaults(func=cmd_experiment)

    bd = sub.add_parser("build-data", help="build evaluation data from GSM8K or BIG-Bench-Hard files")
    fam = bd.add_subparsers(dest="family", required=True)
    mm = fam.add_parser("mistake-math", help="a GSM8K pool with corrupted solutions (+ targets, probes)")
    mm.add_argument("--gsm8k", required=True, help="GSM8K train.jsonl")
    mm.add_argument("--n", type=int, default=300, help="pool size")
    mm.add_argument("--harmful-ratio", type=float, default=0.1)
    mm.add_argument("--seed", type=int, default=0)
    mm.add_argument("--keep-annotations", action="store_true", help="keep the <<a*b=c>> calculator annotations")
    mm.add_argument("--out", required=True, help="pool file (.jsonl)")
    mm.add_argument("--targets-out", default=None, help="also write counterfactual target pairs here")
    mm.add_argument("--n-targets", type=int, default=24)
    mm.add_argument("--n-distractors", type=int, default=0)
    mm.add_argument("--probes-from", default=None, help="GSM8K test.jsonl, for --probes-out")
    mm.add_argument("--probes-out", default=None)
    mm.add_argument("--n-probes", type=int, default=48)
    mm.set_defaults(func=cmd_build_data)
    bb = fam.add_parser("bbh", help="per-task target pairs and held-out probes from BIG-Bench-Hard")
    bb.add_argument("--bbh-dir", required=True, help="folder of <task>.json files")
    bb.add_argument("--n-targets-per-task", type=int, default=3)
    bb.add_argument("--n-heldout-per-task", type=int, default=None)
    bb.add_argument("--tasks", nargs="+", default=None)
    bb.add_argument("--seed", type=int, default=0)
    bb.add_argument("--targets-out", required=True)
    bb.add_argument("--heldout-out", required=True)
    bb.set_defaults(func=cmd_build_data)

    rp = sub.add_parser("report", help="write a self-contained HTML report of an experiment or a score run")
    rp.add_argument("--run", required=True, help="an experiment directory or a score run directory")
    rp.add_argument("--label", default=None, help="boolean label field of the pool (score runs; default harmful)")
    rp.add_argument("--out", default=None, help="page path (default <run>/report.html)")
    rp.set_defaults(func=cmd_report)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prism-select", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)

    sc = sub.add_parser("score", help="score a pool against target pairs")
    sc.add_argument("--pool", required=True, help=".jsonl/.json/.parquet/.csv file or a datasets directory")
    sc.add_argument("--targets", default=None, help="target pairs: prompt + chosen + rejected")
    sc.add_argument("--out", required=True, help="run directory")
    _add_model_args(sc)
    _add_score_args(sc)
    _add_stream_args(sc)
    sc.set_defaults(func=cmd_score)

    se = sub.add_parser("select", help="write the kept pool records in the pool's own format")
    se.add_argument("--run", required=True, help="a finished run directory (scores.jsonl)")
    se.add_argument("--pool", required=True)
    se.add_argument("--out", required=True, help="output file (or directory for a datasets pool)")
    m = se.add_mutually_exclusive_group(required=True)
    m.add_argument("--keep", help="N or P%%: keep the top-ranked (general selection)")
    m.add_argument("--remove", help="N or P%%: remove the top-ranked (repair)")
    se.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    se.add_argument("--allow-other-pool", action="store_true",
                    help="accept a pool file other than the one scored, if every scored id is in it "
                         "(its unscored records are left out and listed)")
    se.set_defaults(func=cmd_select)

    co = sub.add_parser("compare", help="score a pool with several methods (model loaded once, curvature shared)")
    co.add_argument("--pool", required=True, help=".jsonl/.json/.parquet/.csv file or a datasets directory")
    co.add_argument("--targets", default=None, help="target pairs: prompt + chosen + rejected")
    co.add_argument("--out", required=True, help="directory: one run per method, compare.json, compare.md")
    co.add_argument("--methods", nargs="+", required=True, metavar="METHOD",
                    help="methods to run, in order (see `prism-select methods`)")
    co.add_argument("--label", default=None,
                    help="boolean field of the pool records: report AUROC and AUPRC of each method's scores")
    _add_model_args(co)
    _add_score_args(co)  # --option KEY=VALUE for every method, METHOD.KEY=VALUE for one
    co.set_defaults(func=cmd_compare)

    me = sub.add_parser("methods", help="list the scoring methods")
    me.set_defaults(func=cmd_methods)

    de = sub.add_parser("demo", help="score a small generated example with the embedded model")
    de.add_argument("--out", default="prism-demo")
    de.add_argument("--pool-size", type=int, default=40)
    de.add_argument("--batch-size", type=int, default=8)
    de.add_argument("--curvature", default="ekfac")
    de.add_argument("--seed", type=int, default=0)
    de.add_argument("--overwrite", action="store_true")
    de.add_argument("--no-progress", action="store_true")
    _add_model_args(de)
    de.set_defaults(func=cmd_demo)
    _add_evaluation_parsers(sub)
    return p


def main(argv=None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        a.func(a)
    except PrismError as exc:
        print(f"prism-select: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        out = getattr(a, "out", None)
        print("\nprism-select: interrupted. Finished work is kept"
              + (f" in {out}/.partial" if out else "")
              + "; run the same command again to resume.", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
