"""The repair protocol (the paper's App. B): LoRA SFT of the start model on the full
pool (the ``repair`` preset) -> greedy responses to probes before and after -> target
sets: pairs ``(probe, chosen = post-SFT response, rejected = pre-SFT response)`` for the
probes whose verdict got worse (``pair_selection``), and/or counterfactual pairs on
problems outside the pool -> every method scores the pool at the start model
(``score_at: start``) or the fine-tuned one (``post``) -> AUROC -> for each removal
fraction the top records are removed -> SFT again from the same start -> behaviour rate
on the probes (the checker's error rate) and, with capability probes, their accuracy.
Rows ``Start`` (no SFT) and ``Mixed`` (unfiltered SFT) come with every setting;
``oracle: true`` adds the removal of exactly the harmful records. A retraining is
keyed by the set of records kept, so two rows that keep the same records share one.
With ``jobs > 1`` the retrainings wait until every setting is scored and then run in
that many worker processes (each loads the start model once; on a GPU a small model's
SFT is bound by kernel launches, so several share the device well); their results are
the files a sequential run writes, read back in the same order.

Pools: GSM8K mistake math, or ``refusal_trigger`` (money questions refused; the
behaviour rate is then the refusal rate on held-out money questions, and held-out
BBH examples of the pool's tasks are the capability check). The experiment
directory: :mod:`.experiment`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import multiprocessing
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from tqdm.auto import tqdm

from . import builders
from .config import RepairConfig, config_to_dict
from .experiment import (Experiment, finish_experiment, free_cuda_cache, load_start, mean_table, mistake_math_run,
                         pct, rates_by_task, read_jsonl, resolve_methods, respond, score_methods, train_adapter,
                         write_if_changed)

log = logging.getLogger(__name__)


def pairs_from_responses(probes: list, pre: list, post: list, mode: str) -> list:
    """Target pairs ``(probe, chosen = post-SFT response, rejected = pre-SFT response)``
    from the probes ``mode`` selects (see :class:`.config.RepairConfig`'s
    ``pair_selection``); a probe whose two responses are equal, or whose post-SFT
    response is empty, gives none."""
    pre_by = {r["id"]: r for r in pre}
    post_by = {r["id"]: r for r in post}
    pairs = []
    for p in probes:
        a, b = pre_by[p["id"]], post_by[p["id"]]
        if a["response"].strip() == b["response"].strip() or not b["response"].strip():
            continue
        if mode == "worsened" and not (a["correct"] and not b["correct"]):
            continue
        if mode == "wrong_after" and b["correct"]:
            continue
        pairs.append({"id": p["id"], "prompt": p["prompt"], "chosen": b["response"], "rejected": a["response"],
                      "kind": "worsened" if a["correct"] and not b["correct"] else "other"})
    return pairs


def _remove_top(scores_path, pool_path, out_path, count: int) -> dict:
    """Keep the pool minus the ``count`` top-ranked records; written in pool format."""
    from ..selection import choose, read_scores, write_subset
    scores = read_scores(scores_path)
    kept = choose(scores, remove=("count", count)) if count > 0 else {s["id"] for s in scores}
    write_subset(pool_path, kept, out_path)
    written = {r["id"] for r in read_jsonl(out_path)}  # counted from the file just written
    removed = [r["id"] for r in read_jsonl(pool_path) if r["id"] not in written]
    return {"removed": removed, "kept": len(written)}


def _pool_and_probes(exp, cfg, ratio: float, seed: int) -> tuple:
    """``(run dir, pool, pool path, probes, probes path, behaviour task)`` of one (ratio, seed)."""
    if cfg.data.family == "mistake_math":
        rdir, pool, pool_path = mistake_math_run(exp, cfg, ratio, seed)
        probes = builders.gsm8k_probes(cfg.probes.gsm8k_test, cfg.probes.n, seed)
        task = None
    else:
        d = cfg.data
        rdir = exp.out / "runs" / f"r{pct(ratio)}" / f"seed{seed}"
        rdir.mkdir(parents=True, exist_ok=True)
        pool, rest = builders.refusal_trigger_pool(d.gsm8k_train, d.pool_size, ratio, seed, trigger=d.trigger,
                                                   bbh_dir=d.bbh_dir, bbh_tasks=d.bbh_tasks,
                                                   n_bbh_per_task=d.n_bbh_per_task)
        pool_path = rdir / "pool.jsonl"
        write_if_changed(pool_path, pool)
        probes = builders.trigger_probes(cfg.probes.gsm8k_test, cfg.probes.n, seed, trigger=d.trigger)
        if cfg.probes.capability_per_task:
            probes += builders.bbh_probes(d.bbh_dir, rest, cfg.probes.capability_per_task)
        task = "gsm8k"
    probes_path = rdir / "probes.jsonl"
    write_if_changed(probes_path, probes)
    return rdir, pool, pool_path, probes, probes_path, task


def _checker_spec(cfg):
    """The checker of the probes: the behaviour checker, and the capability checker for
    the capability probes when there are any."""
    if cfg.data.family == "mistake_math" or not cfg.probes.capability_per_task:
        return cfg.probes.checker
    return {"name": "by_task", "checkers": {"gsm8k": cfg.probes.checker}, "default": cfg.probes.capability_checker}


def _targets(cfg, variant, rdir: Path, probes: list, pre: Path, post: Path, pool: list, seed: int,
             task) -> tuple:
    """The target pairs of one target set and what the run records about them."""
    info: dict = {}
    if variant.source == "counterfactual":
        if cfg.data.family == "mistake_math":
            pairs = builders.mistake_math_targets(cfg.data.gsm8k_train, variant.n_counterfactual, seed, exclude=pool,
                                                  n_distractors=variant.n_distractors,
                                                  keep_annotations=cfg.data.keep_annotations)
        else:
            pairs = builders.refusal_counterfactual_targets(cfg.data.gsm8k_train, variant.n_counterfactual, seed,
                                                            trigger=cfg.data.trigger, exclude=pool,
                                                            n_distractors=variant.n_distractors)
        info["pair_selection"] = "counterfactual"
        return pairs, info
    beh = [p for p in probes if p.get("task") == task]
    pre_rows = [r for r in read_jsonl(pre) if r.get("task") == task]
    post_rows = [r for r in read_jsonl(post) if r.get("task") == task]
    pairs = pairs_from_responses(beh, pre_rows, post_rows, cfg.pair_selection)
    info["pair_selection"] = cfg.pair_selection
    if len(pairs) < cfg.min_pairs and cfg.fallback_pair_selection:
        info["note"] = (f"{len(pairs)} pair(s) from {cfg.pair_selection} probes, fewer than min_pairs "
                        f"{cfg.min_pairs}: pairs from {cfg.fallback_pair_selection} probes used instead")
        info["pair_selection"] = cfg.fallback_pair_selection
        pairs = pairs_from_responses(beh, pre_rows, post_rows, cfg.fallback_pair_selection)
    info["n_worsened"] = sum(1 for a, b in zip(pre_rows, post_rows) if a["correct"] and not b["correct"])
    info["n_improved"] = sum(1 for a, b in zip(pre_rows, post_rows) if not a["correct"] and b["correct"])
    return pairs, info


def _retrains(spec, fraction: float, method: str) -> bool:
    """Whether ``method``'s removal of ``fraction`` is retrained (``retrain_methods``)."""
    if isinstance(spec, dict):
        spec = spec.get(pct(fraction), spec.get(fraction))
    return spec is None or method in spec


def _retrain_dir(rdir: Path, kept_path: Path) -> Path:
    """``retrain/<hash of the kept ids>``: rows keeping the same records share it."""
    ids = sorted(r["id"] for r in read_jsonl(kept_path))
    return rdir / "retrain" / hashlib.sha256("\n".join(map(str, ids)).encode()).hexdigest()[:16]


def _retrain(exp, lm, rdir: Path, kept_path: Path, probes_path: Path, checker, seed: int, tag: str, task) -> dict:
    """SFT on ``kept_path`` and the rates on the probes; one directory per kept set
    (:func:`_retrain_dir`)."""
    tdir = _retrain_dir(rdir, kept_path)
    tdir.mkdir(parents=True, exist_ok=True)
    pool_copy = tdir / "kept.jsonl"
    write_if_changed(pool_copy, read_jsonl(kept_path))
    adapter = train_adapter(exp, lm, pool_copy, tdir, seed, tag)
    resp = respond(exp, lm, probes_path, tdir, checker, tag, adapter)
    return {"dir": exp.rel(tdir), **rates_by_task(resp, task)}


_worker: dict = {}  # a retraining worker's experiment and start model (_worker_start)


def _worker_start(out: Path, cfg):
    exp = Experiment.attach(out, "repair", cfg)
    _worker.update(exp=exp, lm=load_start(exp, cfg))


def _worker_retrain(args: tuple) -> dict:
    exp = _worker["exp"]
    exp.timings = {}
    _retrain(exp, _worker["lm"], *args)
    return exp.timings


def _retrain_in_processes(exp, cfg, requests: list, jobs: int):
    """Run the retrainings ``requests`` (:func:`_retrain`'s arguments after ``lm``) in
    ``jobs`` worker processes, one per kept set (rows keeping the same records share one);
    their times go to ``exp``'s timings."""
    unique = list({_retrain_dir(a[0], a[1]): a for a in requests}.values())
    log.info("retraining %d kept sets in %d processes", len(unique), min(jobs, len(unique)))
    ctx = multiprocessing.get_context("spawn")  # CUDA cannot be forked
    with ProcessPoolExecutor(max_workers=min(jobs, len(unique)), mp_context=ctx, initializer=_worker_start,
                             initargs=(exp.out, cfg)) as pool:
        futures = [pool.submit(_worker_retrain, a) for a in unique]
        for f in tqdm(as_completed(futures), total=len(futures), desc="retraining", unit="SFT", leave=False):
            for name, seconds in f.result().items():
                exp.time(name, seconds)


def repair(config: RepairConfig, out_dir, *, overwrite: bool = False, jobs: int = 1) -> dict:
    """The repair protocol (module docstring); returns the content of results.json.
    ``jobs``: worker processes for the retrainings (1: each in turn, in this process)."""
    from ..model import load_model
    cfg = config
    exp = Experiment(out_dir, "repair", cfg, overwrite)
    methods_all = resolve_methods(cfg.methods)
    lm = load_start(exp, cfg)
    checker = _checker_spec(cfg)
    deferred: list = []  # (row to fill, _retrain's arguments) with jobs > 1

    def retrain(*args) -> dict:
        if jobs <= 1:
            return _retrain(exp, lm, *args)
        row: dict = {}
        deferred.append((row, args))
        return row

    runs = []
    for ratio in cfg.harmful_ratios:
        fractions = cfg.remove_fractions or [cfg.remove_fraction if cfg.remove_fraction is not None else ratio]
        for seed in cfg.seeds:
            rdir, pool, pool_path, probes, probes_path, task = _pool_and_probes(exp, cfg, ratio, seed)
            harmful_ids = {p["id"] for p in pool if p["harmful"]}
            # 1. pre- and post-SFT responses
            pre = respond(exp, lm, probes_path, rdir / "start", checker, "start")
            mixed_adapter = train_adapter(exp, lm, pool_path, rdir / "mixed", seed, "mixed")
            post = respond(exp, lm, probes_path, rdir / "mixed", checker, "mixed", mixed_adapter)
            base = {"Start": {"dir": exp.rel(rdir / "start"), **rates_by_task(pre, task)},
                    "Mixed": {"dir": exp.rel(rdir / "mixed"), **rates_by_task(post, task)}}
            oracle = None
            if cfg.oracle and cfg.retrain:  # exactly the harmful records removed, whatever the fraction
                odir = rdir / "oracle"
                odir.mkdir(parents=True, exist_ok=True)
                write_if_changed(odir / "kept.jsonl", [p for p in pool if not p["harmful"]])
                oracle = retrain(rdir, odir / "kept.jsonl", probes_path, checker, seed, "oracle", task)
            for variant in cfg.targets:
                vdir = rdir / variant.name
                vdir.mkdir(parents=True, exist_ok=True)
                run = {"setting": f"{variant.name} @ {pct(ratio)}%", "variant": variant.name, "harmful_ratio": ratio,
                       "seed": seed, "dir": exp.rel(vdir), "pool": exp.rel(pool_path), "probes": exp.rel(probes_path),
                       "label": "harmful", "n_pool": len(pool), "n_harmful": len(harmful_ids),
                       "n_probes": len(probes), "fractions": [pct(f) for f in fractions], "methods": {},
                       "rates": {pct(f): dict(base) for f in fractions}, "removed": {pct(f): {} for f in fractions}}
                if oracle is not None:
                    for f in fractions:
                        run["rates"][pct(f)]["Oracle"] = oracle
                        run["removed"][pct(f)]["Oracle"] = {"n": len(harmful_ids), "harmful": len(harmful_ids)}
                # 2. target pairs
                pairs, info = _targets(cfg, variant, vdir, probes, pre, post, pool, seed, task)
                run.update(info)
                targets_path = vdir / "targets.jsonl"
                write_if_changed(targets_path, pairs)
                run["targets"] = exp.rel(targets_path)
                run["n_pairs"] = len(pairs)
                if not pairs:
                    run["note"] = (f"no probe qualified as a target pair ({run['pair_selection']}): "
                                   "nothing to score; methods left out of this setting")
                    runs.append(run)
                    continue
                # 3. scores at the start (or post-SFT) model
                methods = resolve_methods(variant.methods) if variant.methods else methods_all
                if cfg.score_at == "post":
                    score_lm = load_model(dataclasses.replace(cfg.model, adapter=str(mixed_adapter)))
                else:
                    score_lm = lm
                run["methods"] = score_methods(exp, score_lm, pool_path, targets_path, vdir, methods, seed)
                if score_lm is not lm:
                    del score_lm
                    free_cuda_cache()
                run["pi"] = (run["methods"].get("prism") or {}).get("pi")
                # 4. filter and retrain, per removal fraction
                for f in fractions:
                    n_remove = builders.harmful_count(len(pool), f)
                    for m in methods:
                        if run["methods"].get(m, {}).get("status") != "ok":
                            continue
                        mdir = vdir / "removal" / f"k{pct(f)}" / m
                        mdir.mkdir(parents=True, exist_ok=True)
                        rem = _remove_top(exp.out / run["methods"][m]["dir"] / "scores.jsonl", pool_path,
                                          mdir / "kept.jsonl", n_remove)
                        run["removed"][pct(f)][m] = {"n": len(rem["removed"]),
                                                     "harmful": sum(1 for i in rem["removed"] if i in harmful_ids)}
                        if cfg.retrain and _retrains(variant.retrain_methods, f, m):
                            run["rates"][pct(f)][m] = retrain(rdir, mdir / "kept.jsonl", probes_path, checker,
                                                              seed, f"retrain:{m}", task)
                runs.append(run)
    if deferred:
        _retrain_in_processes(exp, cfg, [a for _, a in deferred], jobs)
        for row, args in deferred:  # each finds its SFT and responses finished
            row.update(_retrain(exp, lm, *args))
    return finish_experiment(exp, _results(exp, cfg, lm, runs))


def _results(exp, cfg, lm, runs: list) -> dict:
    """results.json's content: the runs and their tables."""
    method_rows = list(dict.fromkeys(m for r in runs for m in r["methods"]))
    fractions = list(dict.fromkeys(f for r in runs for f in r["fractions"]))
    rows = ["Start", "Mixed"] + method_rows + (["Oracle"] if cfg.oracle and cfg.retrain else [])
    behaviour = "refusal rate on held-out money questions" if cfg.data.family == "refusal_trigger" else \
        "probe error rate"

    def auroc_of(run, m, st):
        return (run["methods"].get(m) or {}).get("auroc")

    def rate(f, key):
        return lambda run, m, st: ((run["rates"].get(f) or {}).get(m) or {}).get(key)

    def removed_of(f):
        def value(run, m, st):
            r = (run["removed"].get(f) or {}).get(m)
            return None if not r or not run["n_harmful"] else r["harmful"] / run["n_harmful"]
        return value

    tables = [mean_table("auroc", f"Ranking AUROC of the harmful flag, scored at the {cfg.score_at} model", runs,
                         method_rows, auroc_of)]
    for f in fractions:
        sfx = f"remove top {f}%"
        tables.append(mean_table(f"behaviour_k{f}", f"Behaviour ({behaviour}) after filtering and retraining, "
                                 f"{sfx} (lower is better)", runs, rows, rate(f, "behaviour_rate"),
                                 lower_is_better=True, note="Start: the start model; Mixed: SFT on the unfiltered "
                                 "pool; Oracle: exactly the harmful records removed"))
        if any((r["rates"].get(f) or {}).get("Mixed", {}).get("capability") is not None for r in runs):
            tables.append(mean_table(f"capability_k{f}", f"Capability check (held-out accuracy on the pool's BBH "
                                     f"tasks) after filtering and retraining, {sfx} (higher is better)", runs, rows,
                                     rate(f, "capability")))
        tables.append(mean_table(f"harmful_removed_k{f}", f"Recall of the removal, {sfx}: harmful records removed "
                                 "/ all harmful records", runs, method_rows + (["Oracle"] if cfg.oracle else []),
                                 removed_of(f)))
    return {"protocol": "repair", "config": config_to_dict(cfg), "methods": method_rows,
            "settings": tables[0]["columns"], "fractions": fractions, "seeds": cfg.seeds, "runs": runs,
            "tables": tables,
            "model": {"fingerprint": lm.fingerprint, **{k: v for k, v in lm.source.items() if k != "versions"}}}
