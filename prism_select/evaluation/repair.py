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
SFT is bound by kernel launches, so several share the device well; with several visible
GPUs the workers are dealt over them in turn); their results are the files a sequential
run writes, read back in the same order.

Pools: GSM8K mistake math, or ``refusal_trigger`` (money questions refused; the
behaviour rate is then the refusal rate on held-out money questions, and held-out
BBH examples of the pool's tasks are the capability check). The experiment
directory: :mod:`.experiment`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import multiprocessing
import os
import random
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..io import atomic_write_json, sha256_file
from ..model import load_model
from ..selection import choose, read_scores, write_subset
from . import carry, verdict
from .builders.bbh import bbh_probes
from .builders.gsm8k import gsm8k_probes, harmful_count, mistake_math_targets
from .builders.trigger import refusal_counterfactual_targets, refusal_trigger_pool, trigger_probes
from .behaviour import harmful_answer_rate, harmful_preference, has_behaviour_fields
from .config import config_to_dict
from .sections import RepairConfig, finetune_settings
from .experiment import (Experiment, adapted, finish_experiment, free_cuda_cache, load_start, load_start_settings,
                         mean_table,
                         finetuned_responses, kept_adapter_step, mistake_math_run, paired_table, pct, rates_by_task, read_jsonl,
                         resolve_methods, respond, score_methods, train_adapter, write_if_changed)
from .floors import floors, with_targets

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
    scores = read_scores(scores_path)
    kept = choose(scores, remove=("count", count)) if count > 0 else {s["id"] for s in scores}
    write_subset(pool_path, kept, out_path)
    written = {r["id"] for r in read_jsonl(out_path)}  # counted from the file just written
    removed = [r["id"] for r in read_jsonl(pool_path) if r["id"] not in written]
    return {"removed": removed, "kept": len(written)}


def _carry_data(cfg, ratio: float, seed: int) -> dict:
    """The dropped-carry family's pool, probes, counterfactual targets and warm-up records."""
    n_cf = max([t.n_counterfactual for t in cfg.targets if t.source == "counterfactual"], default=0)
    return carry.build(seed, pool_size=cfg.data.pool_size, harmful_ratio=ratio, carry_share=cfg.data.carry_share,
                       n_probes=cfg.probes.n, n_capability=cfg.probes.capability_per_task, n_counterfactual=n_cf,
                       n_warmup=cfg.warmup.n_records if cfg.warmup else 0,
                       n_distractors=max([t.n_distractors for t in cfg.targets
                                          if t.distractor_kind == "shuffled_answer"], default=0))


def _verdict_data(cfg, ratio: float, seed: int) -> dict:
    """The carry-verdict family's pool, probes and warm-up records."""
    return verdict.build(seed, pool_size=cfg.data.pool_size, harmful_ratio=ratio, carry_share=cfg.data.carry_share,
                         n_probes=cfg.probes.n, n_capability=cfg.probes.capability_per_task,
                         n_warmup=cfg.warmup.n_records if cfg.warmup else 0)


def _carry_distractors(cfg, variant, ratio: float, seed: int, built: dict | None = None) -> list:
    """A dropped-carry target set's ``n_distractors`` pairs of its ``distractor_kind``; the
    shuffled-answer ones from ``built`` (the seed's :func:`_carry_data` at ``ratio``, made
    here when not given), the unrelated ones without it."""
    if variant.distractor_kind == "unrelated":
        return carry.unrelated_distractors(variant.n_distractors, seed)
    return (built or _carry_data(cfg, ratio, seed))["distractors"][:variant.n_distractors]


def pool_and_probes(exp, cfg, ratio: float, seed: int) -> tuple:
    """``(run dir, pool, pool path, probes, probes path, behaviour task)`` of one (ratio, seed)."""
    if cfg.data.family in ("dropped_carry", "carry_verdict"):
        rdir = exp.out / "runs" / f"r{pct(ratio)}" / f"seed{seed}"
        rdir.mkdir(parents=True, exist_ok=True)
        built = _carry_data(cfg, ratio, seed) if cfg.data.family == "dropped_carry" else _verdict_data(cfg, ratio, seed)
        pool, probes, task = built["pool"], built["probes"], carry.BEHAVIOUR_TASK
        pool_path = rdir / "pool.jsonl"
        write_if_changed(pool_path, pool)
    elif cfg.data.family == "mistake_math":
        rdir, pool, pool_path = mistake_math_run(exp, cfg, ratio, seed)
        probes = gsm8k_probes(cfg.probes.gsm8k_test, cfg.probes.n, seed)
        task = None
    else:
        d = cfg.data
        rdir = exp.out / "runs" / f"r{pct(ratio)}" / f"seed{seed}"
        rdir.mkdir(parents=True, exist_ok=True)
        pool, rest = refusal_trigger_pool(d.gsm8k_train, d.pool_size, ratio, seed, trigger=d.trigger,
                                          bbh_dir=d.bbh_dir, bbh_tasks=d.bbh_tasks,
                                          n_bbh_per_task=d.n_bbh_per_task)
        pool_path = rdir / "pool.jsonl"
        write_if_changed(pool_path, pool)
        probes = trigger_probes(cfg.probes.gsm8k_test, cfg.probes.n, seed, trigger=d.trigger)
        if cfg.probes.capability_per_task:
            probes += bbh_probes(d.bbh_dir, rest, cfg.probes.capability_per_task)
        task = "gsm8k"
    probes_path = rdir / "probes.jsonl"
    write_if_changed(probes_path, probes)
    return rdir, pool, pool_path, probes, probes_path, task


def checker_spec(cfg):
    """The checker of the probes: the behaviour checker, and the capability checker for
    the capability probes when there are any."""
    if cfg.data.family in ("mistake_math", "dropped_carry", "carry_verdict") or not cfg.probes.capability_per_task:
        return cfg.probes.checker
    return {"name": "by_task", "checkers": {"gsm8k": cfg.probes.checker}, "default": cfg.probes.capability_checker}


def _targets(cfg, variant, rdir: Path, probes: list, pre: Path, post: Path, pool: list, seed: int,
             task, ratio: float) -> tuple:
    """The target pairs of one target set and what the run records about them. Dropped
    carry's distractor pairs are drawn after the pool of this ``ratio`` (none of its problems)."""
    info: dict = {}
    if variant.source == "counterfactual":
        if cfg.data.family == "dropped_carry":
            built = _carry_data(cfg, ratio, seed)
            pairs = built["targets"][:variant.n_counterfactual] + _carry_distractors(cfg, variant, ratio, seed, built)
        elif cfg.data.family == "mistake_math":
            pairs = mistake_math_targets(cfg.data.gsm8k_train, variant.n_counterfactual, seed, exclude=pool,
                                         n_distractors=variant.n_distractors,
                                         keep_annotations=cfg.data.keep_annotations)
        else:
            pairs = refusal_counterfactual_targets(cfg.data.gsm8k_train, variant.n_counterfactual, seed,
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
    if variant.n_distractors:  # dropped carry (the config checks): pairs the model strongly disprefers
        pairs = pairs + _carry_distractors(cfg, variant, ratio, seed)
        info["n_distractors"] = variant.n_distractors
    return pairs, info


def _retrains(spec, fraction: float, method: str) -> bool:
    """Whether ``method``'s removal of ``fraction`` is retrained (``retrain_methods``)."""
    if isinstance(spec, dict):
        spec = spec.get(pct(fraction), spec.get(fraction))
    return spec is None or method in spec


def retrain_dir(rdir: Path, kept_path: Path, ft_seed: int | None = None) -> Path:
    """``retrain/<hash of the kept ids>[-ft<seed>]``: rows keeping the same records share it
    (one per fine-tuning seed when the config lists ``finetune_seeds``)."""
    ids = sorted(r["id"] for r in read_jsonl(kept_path))
    name = hashlib.sha256("\n".join(map(str, ids)).encode()).hexdigest()[:16]
    return rdir / "retrain" / (name if ft_seed is None else f"{name}-ft{ft_seed}")


def _behaviour(exp, lm, probes_path: Path, responses_path: Path, out_dir: Path, adapter, task) -> dict:
    """``harmful_answer_rate`` and ``harmful_preference`` (:mod:`.behaviour`) of the start
    model or of it with ``adapter``, when the probes spell the behaviour out; reused when
    the probes and the adapter are unchanged."""
    probes = read_jsonl(probes_path)
    if not has_behaviour_fields(probes):
        return {}
    if adapter is None:
        model = lm.fingerprint
    elif (Path(adapter) / "adapter_model.safetensors").is_file():
        model = sha256_file(Path(adapter) / "adapter_model.safetensors")
    else:  # the adapter is gone from a copied folder: its kept measurement (the caller checked)
        model = _kept_behaviour_model(exp, lm, probes_path, responses_path, out_dir)
    key = _behaviour_key(probes_path, responses_path, model)
    path = out_dir / "behaviour.json"
    if exp.done(out_dir, key, ["behaviour.json"], "behaviour-step"):
        return json.loads(path.read_text())
    beh = [p for p in probes if p.get("task") == task]
    with adapted(lm, adapter) as m:
        prefs = harmful_preference(m, beh)
    out = {"harmful_answer_rate": harmful_answer_rate(probes, read_jsonl(responses_path), task),
           "harmful_preference": sum(prefs) / len(prefs) if prefs else float("nan")}
    atomic_write_json(path, out)
    exp.finish(out_dir, key, "behaviour-step")
    return out


def _behaviour_key(probes_path: Path, responses_path: Path, model: str) -> dict:
    return {"probes": sha256_file(probes_path), "responses": sha256_file(responses_path), "model": model}


def _kept_behaviour_model(exp, lm, probes_path: Path, responses_path: Path, out_dir: Path) -> str | None:
    """The adapter hash of a finished :func:`_behaviour` step in ``out_dir`` measured with an
    adapter on the same probes and responses, or None (:func:`kept_adapter_step`)."""
    return kept_adapter_step(exp, lm, out_dir, "behaviour-step", ["behaviour.json"],
                             lambda model: _behaviour_key(probes_path, responses_path, model))


def _mixed_sft(exp, cfg, lm, pool_path: Path, probes_path: Path, mdir: Path, checker, seed: int):
    """The Mixed SFT on the whole pool and its responses to the probes: (adapter dir, responses).

    In a folder copied without its adapters the SFT is not run again where nothing needs the
    adapter itself: its responses are kept (:func:`finetuned_responses`), the scores are taken
    at the start model, and the Mixed row is either retrained per fine-tuning seed or its
    behaviour measurement is kept."""
    adapter = mdir / "adapter"
    post = finetuned_responses(exp, lm, pool_path, mdir, probes_path, mdir, seed, "mixed", checker)
    if not (adapter / "adapter_config.json").is_file() and (
            cfg.score_at == "post" or (not cfg.finetune_seeds and has_behaviour_fields(read_jsonl(probes_path))
                                       and _kept_behaviour_model(exp, lm, probes_path, post, mdir) is None)):
        adapter = train_adapter(exp, lm, pool_path, mdir, seed, "mixed")
        post = respond(exp, lm, probes_path, mdir, checker, "mixed", adapter)
    return adapter, post


def _retrain_one(exp, lm, rdir: Path, kept_path: Path, probes_path: Path, checker, ft_seed: int, tag: str,
                 task, named: bool) -> dict:
    """One SFT on ``kept_path`` (seeded ``ft_seed``) and its rates on the probes.

    A finished retraining is recognised by its inputs alone (the kept records, the start
    model, the SFT settings, the probes, decoding and checker: ``.retrain-step.json``), so a
    run copied without its adapters, to another machine, resumes without training again."""
    tdir = retrain_dir(rdir, kept_path, ft_seed if named else None)
    tdir.mkdir(parents=True, exist_ok=True)
    pool_copy = tdir / "kept.jsonl"
    write_if_changed(pool_copy, read_jsonl(kept_path))
    key = {"kept": sha256_file(pool_copy), "model": lm.fingerprint, "probes": sha256_file(probes_path),
           "finetune": dataclasses.asdict(finetune_settings(exp.cfg.finetune, ft_seed)),
           "generation": dataclasses.asdict(exp.cfg.generation), "checker": checker}
    if not exp.done(tdir, key, ["responses.jsonl"], "retrain-step"):
        adapter = train_adapter(exp, lm, pool_copy, tdir, ft_seed, tag)
        resp = respond(exp, lm, probes_path, tdir, checker, tag, adapter)
        _behaviour(exp, lm, probes_path, resp, tdir, adapter, task)
        exp.finish(tdir, key, "retrain-step")
    resp = tdir / "responses.jsonl"
    beh = json.loads((tdir / "behaviour.json").read_text()) if (tdir / "behaviour.json").is_file() else {}
    return {"dir": exp.rel(tdir), **rates_by_task(resp, task), **beh}


_AVERAGED = ("behaviour_rate", "capability", "harmful_answer_rate", "harmful_preference")


def _retrain_jobs(cfg, rdir: Path, kept_path: Path, probes_path: Path, checker, seed: int, tag: str,
                  task) -> list:
    """The single SFTs (:func:`_retrain_one`'s arguments after ``lm``) one kept set needs."""
    if not cfg.finetune_seeds:
        return [(rdir, kept_path, probes_path, checker, seed, tag, task, False)]
    return [(rdir, kept_path, probes_path, checker, s, tag, task, True) for s in cfg.finetune_seeds]


def _retrain(exp, lm, *args) -> dict:
    """SFT on a kept set (once per fine-tuning seed) and the rates on the probes: with
    several seeds, each rate is their mean and ``by_finetune_seed`` holds each SFT's."""
    rows = [_retrain_one(exp, lm, *job) for job in _retrain_jobs(exp.cfg, *args)]
    if len(rows) == 1:
        return rows[0]
    out = {"dirs": [r["dir"] for r in rows], "by_finetune_seed": rows, "n_behaviour": rows[0].get("n_behaviour")}
    for k in _AVERAGED:
        vals = [r.get(k) for r in rows]
        if all(isinstance(v, (int, float)) for v in vals):
            out[k] = sum(vals) / len(vals)
    return out


_worker: dict = {}  # a retraining worker's experiment and start model (_worker_start)


def _worker_start(out: Path, cfg, gpus: list, counter):
    """A retraining worker's start: its GPU (the ``counter``-th of ``gpus`` in turn, set
    before CUDA starts in this process), the experiment and the start model."""
    if gpus:
        with counter.get_lock():
            index = counter.value
            counter.value += 1
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus[index % len(gpus)]
    exp = Experiment.attach(out, "repair", cfg)
    _worker.update(exp=exp, lm=load_start(exp, cfg))


def visible_gpus() -> list:
    """The GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` names them (their
    indices when it is unset); empty without CUDA."""
    if not torch.cuda.is_available():
        return []
    named = os.environ.get("CUDA_VISIBLE_DEVICES")
    if named:
        return [g.strip() for g in named.split(",") if g.strip()][:torch.cuda.device_count()]
    return [str(i) for i in range(torch.cuda.device_count())]


def _worker_retrain(job: tuple) -> dict:
    exp = _worker["exp"]
    exp.timings = {}
    _retrain_one(exp, _worker["lm"], *job)
    return exp.timings


def _retrain_in_processes(exp, cfg, requests: list, jobs: int):
    """Run the retrainings ``requests`` (:func:`_retrain`'s arguments after ``lm``) in
    ``jobs`` worker processes, one per SFT (rows keeping the same records share theirs);
    their times go to ``exp``'s timings."""
    singles = [j for a in requests for j in _retrain_jobs(cfg, *a)]
    unique = list({retrain_dir(j[0], j[1], j[4] if j[7] else None): j for j in singles}.values())
    log.info("retraining %d SFTs in %d processes", len(unique), min(jobs, len(unique)))
    ctx = multiprocessing.get_context("spawn")  # CUDA cannot be forked
    gpus = visible_gpus()
    with ProcessPoolExecutor(max_workers=min(jobs, len(unique)), mp_context=ctx, initializer=_worker_start,
                             initargs=(exp.out, cfg, gpus, ctx.Value("i", 0))) as pool:
        futures = [pool.submit(_worker_retrain, j) for j in unique]
        done = tqdm(as_completed(futures), total=len(futures), desc="retraining", unit="SFT", leave=False)
        for i, f in enumerate(done, 1):
            times = f.result()
            for name, seconds in times.items():
                exp.time(name, seconds)
            log.info("retraining: %d of %d SFTs done (%s)", i, len(futures),
                     ", ".join(f"{name} {seconds:.0f} s" for name, seconds in times.items()))


def repair(config: RepairConfig, out_dir, *, overwrite: bool = False, jobs: int = 1) -> dict:
    """The repair protocol (module docstring); returns the content of results.json.
    ``jobs``: worker processes for the retrainings (1: each in turn, in this process)."""
    cfg = config
    exp = Experiment(out_dir, "repair", cfg, overwrite)
    methods_all = resolve_methods(cfg.methods)
    lm = load_start(exp, cfg)
    checker = checker_spec(cfg)
    deferred: list = []  # (row to fill, _retrain's arguments) with jobs > 1

    def retrain(*args) -> dict:
        if jobs <= 1:
            return _retrain(exp, lm, *args)
        row: dict = {}
        deferred.append((row, args))
        return row

    runs = []
    for ratio in cfg.harmful_ratios:
        for seed in cfg.seeds:
            runs += _setting(exp, cfg, lm, ratio, seed, checker, methods_all, retrain)
    if deferred:
        _retrain_in_processes(exp, cfg, [a for _, a in deferred], jobs)
        for row, args in deferred:  # each finds its SFTs and responses finished
            row.update(_retrain(exp, lm, *args))
    return finish_experiment(exp, _results(exp, cfg, lm, runs))


def _reference_rows(exp, cfg, lm, ctx: dict, retrain) -> dict:
    """Rows every target set of one (ratio, seed) shares: Start, Mixed, the Oracle and the
    partial Oracles (``Oracle q%``: a seeded random share ``q`` of the harmful records removed)."""
    rdir, pool, probes_path, task, seed = ctx["rdir"], ctx["pool"], ctx["probes_path"], ctx["task"], ctx["seed"]
    rows = {"Start": {"dir": exp.rel(rdir / "start"), **rates_by_task(ctx["pre"], task),
                      **_behaviour(exp, lm, probes_path, ctx["pre"], rdir / "start", None, task)}}
    if cfg.finetune_seeds:  # the Mixed row over the same fine-tuning seeds as every other row
        rows["Mixed"] = retrain(rdir, ctx["pool_path"], probes_path, ctx["checker"], seed, "mixed", task)
    else:
        rows["Mixed"] = {"dir": exp.rel(rdir / "mixed"), **rates_by_task(ctx["post"], task),
                         **_behaviour(exp, lm, probes_path, ctx["post"], rdir / "mixed", ctx["mixed_adapter"], task)}
    removed = {}
    if cfg.oracle and cfg.retrain:
        harmful = sorted((p["id"] for p in pool if p["harmful"]), key=str)
        shares = [(f"Oracle {pct(q)}%", q) for q in cfg.partial_oracles] + [("Oracle", 1.0)]
        for name, q in shares:
            drop = set(random.Random(f"partial-oracle:{seed}:{q}").sample(harmful, round(q * len(harmful))))
            odir = rdir / ("oracle" if q == 1.0 else f"oracle-{pct(q)}")
            odir.mkdir(parents=True, exist_ok=True)
            write_if_changed(odir / "kept.jsonl", [p for p in pool if p["id"] not in drop])
            rows[name] = retrain(rdir, odir / "kept.jsonl", probes_path, ctx["checker"], seed, "oracle", task)
            removed[name] = {"n": len(drop), "harmful": len(drop)}
    return {"rates": rows, "removed": removed}


def family_floors(family: str = "dropped_carry"):
    """The floors of a generated family (name -> record -> score), None for the others.
    Dropped carry: the knowledge floors (``checker``, the ideal judge; ``carry_in_prompt``)
    and two label-free rules, the builder's leak (``sum_100_109``) and the density ratio
    over the stated sum's digits (``density_ratio_sum_digits``). Carry verdict: its checker
    and ``carry_in_prompt``."""
    if family == "dropped_carry":
        return {"checker": carry.arithmetic_error, "carry_in_prompt": carry.carry_in_prompt,
                "sum_100_109": carry.sum_in_skipped_range,
                "density_ratio_sum_digits": with_targets(carry.sum_digit_density_ratio)}
    if family == "carry_verdict":
        return {"checker": verdict.verdict_error, "carry_in_prompt": verdict.carry_in_prompt}
    return None


def _setting(exp, cfg, lm, ratio: float, seed: int, checker, methods_all: list, retrain) -> list:
    """Every target set's run of one (harmful ratio, seed)."""
    fractions = cfg.remove_fractions or [cfg.remove_fraction if cfg.remove_fraction is not None else ratio]
    rdir, pool, pool_path, probes, probes_path, task = pool_and_probes(exp, cfg, ratio, seed)
    harmful_ids = {p["id"] for p in pool if p["harmful"]}
    # 1. pre- and post-SFT responses
    pre = respond(exp, lm, probes_path, rdir / "start", checker, "start")
    mixed_adapter, post = _mixed_sft(exp, cfg, lm, pool_path, probes_path, rdir / "mixed", checker, seed)
    ctx = {"rdir": rdir, "pool": pool, "pool_path": pool_path, "probes_path": probes_path, "task": task,
           "seed": seed, "pre": pre, "post": post, "mixed_adapter": mixed_adapter, "checker": checker}
    ref = _reference_rows(exp, cfg, lm, ctx, retrain)
    runs = []
    for variant in cfg.targets:
        vdir = rdir / variant.name
        vdir.mkdir(parents=True, exist_ok=True)
        run = {"setting": f"{variant.name} @ {pct(ratio)}%", "variant": variant.name, "harmful_ratio": ratio,
               "seed": seed, "dir": exp.rel(vdir), "pool": exp.rel(pool_path), "probes": exp.rel(probes_path),
               "label": "harmful", "n_pool": len(pool), "n_harmful": len(harmful_ids),
               "n_probes": len(probes), "fractions": [pct(f) for f in fractions], "methods": {},
               "rates": {pct(f): dict(ref["rates"]) for f in fractions},
               "removed": {pct(f): dict(ref["removed"]) for f in fractions}}
        # 2. target pairs
        pairs, info = _targets(cfg, variant, vdir, probes, pre, post, pool, seed, task, ratio)
        run.update(info)
        targets_path = vdir / "targets.jsonl"
        write_if_changed(targets_path, pairs)
        run["targets"] = exp.rel(targets_path)
        run["n_pairs"] = len(pairs)
        if cfg.floors:
            run["floors"] = floors(pool, pairs, extra=family_floors(cfg.data.family))
        if not pairs:
            run["note"] = (f"no probe qualified as a target pair ({run['pair_selection']}): "
                           "nothing to score; methods left out of this setting")
            runs.append(run)
            continue
        # 3. scores at the start (or post-SFT) model
        methods = resolve_methods(variant.methods) if variant.methods else methods_all
        score_lm = load_model(dataclasses.replace(load_start_settings(exp, cfg), adapter=str(mixed_adapter))) \
            if cfg.score_at == "post" else lm
        run["methods"] = score_methods(exp, score_lm, pool_path, targets_path, vdir, methods, seed)
        if score_lm is not lm:
            del score_lm
            free_cuda_cache()
        run["pi"] = (run["methods"].get("prism") or {}).get("pi")
        # 4. filter and retrain, per removal fraction
        for f in fractions:
            _filter_and_retrain(exp, cfg, run, variant, f, ctx, methods, harmful_ids, retrain)
        runs.append(run)
    return runs


def _filter_and_retrain(exp, cfg, run: dict, variant, f: float, ctx: dict, methods: list, harmful_ids: set,
                        retrain):
    """Remove each method's top ``f`` of the pool and retrain (where the config asks)."""
    n_remove = harmful_count(len(ctx["pool"]), f)
    vdir = exp.out / run["dir"]
    for m in methods:
        if run["methods"].get(m, {}).get("status") != "ok":
            continue
        mdir = vdir / "removal" / f"k{pct(f)}" / m
        mdir.mkdir(parents=True, exist_ok=True)
        rem = _remove_top(exp.out / run["methods"][m]["dir"] / "scores.jsonl", ctx["pool_path"],
                          mdir / "kept.jsonl", n_remove)
        run["removed"][pct(f)][m] = {"n": len(rem["removed"]),
                                     "harmful": sum(1 for i in rem["removed"] if i in harmful_ids)}
        if cfg.retrain and _retrains(variant.retrain_methods, f, m):
            run["rates"][pct(f)][m] = retrain(ctx["rdir"], mdir / "kept.jsonl", ctx["probes_path"], ctx["checker"],
                                              ctx["seed"], f"retrain:{m}", ctx["task"])


_BEHAVIOUR = {"refusal_trigger": "refusal rate on held-out money questions",
              "dropped_carry": "error rate on held-out carry problems",
              "carry_verdict": "verdict error rate on held-out carry problems"}
_CAPABILITY = {"dropped_carry": "accuracy on held-out no-carry problems",
               "carry_verdict": "verdict accuracy on held-out no-carry problems"}


def _results(exp, cfg, lm, runs: list) -> dict:
    """results.json's content: the runs and their tables."""
    method_rows = list(dict.fromkeys(m for r in runs for m in r["methods"]))
    fractions = list(dict.fromkeys(f for r in runs for f in r["fractions"]))
    oracles = ([f"Oracle {pct(q)}%" for q in cfg.partial_oracles] + ["Oracle"]) if cfg.oracle and cfg.retrain else []
    rows = ["Start", "Mixed"] + method_rows + oracles
    floor_rows = list(dict.fromkeys(k for r in runs for k in r.get("floors", {})))

    def auroc_cell(run, m, st):  # a method's AUROC, or a floor's
        if m.startswith("floor: "):
            return (run.get("floors", {}).get(m[7:]) or {}).get("auroc")
        return (run["methods"].get(m) or {}).get("auroc")

    tables = [mean_table("auroc", f"Ranking AUROC of the harmful flag, scored at the {cfg.score_at} model", runs,
                         method_rows + [f"floor: {k}" for k in floor_rows], auroc_cell,
                         note="floor: rules that read the text, not the model (keyword and length rules are chosen "
                         "with the labels, so optimistic; the density ratios and sum_100_109 are label-free); "
                         "checker (an ideal judge) and carry_in_prompt need to know the task")]
    for f in fractions:
        tables += _fraction_tables(cfg, runs, f, rows, method_rows, oracles)
    return {"protocol": "repair", "config": config_to_dict(cfg), "methods": method_rows,
            "settings": tables[0]["columns"], "fractions": fractions, "seeds": cfg.seeds, "runs": runs,
            "tables": tables,
            "model": {"fingerprint": lm.fingerprint, **{k: v for k, v in lm.source.items() if k != "versions"}}}


def _fraction_tables(cfg, runs: list, f: str, rows: list, method_rows: list, oracles: list) -> list:
    """The tables of one removal fraction: behaviour, its measurements, capability, recall
    and the paired differences against the comparators."""
    sfx = f"remove top {f}%"

    def rate(key):
        return lambda run, m, st: ((run["rates"].get(f) or {}).get(m) or {}).get(key)

    def removed_of(run, m, st):
        r = (run["removed"].get(f) or {}).get(m)
        return None if not r or not run["n_harmful"] else r["harmful"] / run["n_harmful"]

    def present(key):
        return any(((r["rates"].get(f) or {}).get("Mixed") or {}).get(key) is not None for r in runs)

    seeds = f" (mean of {len(cfg.finetune_seeds)} fine-tuning seeds per data seed)" if cfg.finetune_seeds else ""
    note = ("Start: the start model; Mixed: SFT on the unfiltered pool; Oracle: exactly the harmful records "
            "removed; Oracle q%: a random q of them removed" + seeds)
    behaviour = _BEHAVIOUR.get(cfg.data.family, "probe error rate")
    out = [mean_table(f"behaviour_k{f}", f"Behaviour ({behaviour}) after filtering and retraining, {sfx} "
                      "(lower is better)", runs, rows, rate("behaviour_rate"), lower_is_better=True, note=note)]
    if present("harmful_answer_rate"):
        out.append(mean_table(f"harmful_answer_k{f}", f"Harmful answers (the behaviour itself: the final answer is "
                              f"the harmful one) after filtering and retraining, {sfx} (lower is better)", runs, rows,
                              rate("harmful_answer_rate"), lower_is_better=True, note=note))
    if present("harmful_preference"):
        out.append(mean_table(f"harmful_preference_k{f}", f"Harmful preference (mean probability of the harmful "
                              f"answer against the true one) after filtering and retraining, {sfx} (lower is better)",
                              runs, rows, rate("harmful_preference"), lower_is_better=True, note=note))
    if present("capability"):
        cap = _CAPABILITY.get(cfg.data.family, "held-out accuracy on the pool's BBH tasks")
        out.append(mean_table(f"capability_k{f}", f"Capability check ({cap}) after filtering and retraining, {sfx} "
                              "(higher is better)", runs, rows, rate("capability")))
    out.append(mean_table(f"harmful_removed_k{f}", f"Recall of the removal, {sfx}: harmful records removed / all "
                          "harmful records", runs, method_rows + oracles, removed_of))
    for key in ("harmful_preference", "behaviour_rate"):
        comparators = [c for c in cfg.comparators if c in method_rows]
        if comparators and present(key) and len(cfg.seeds) > 1:  # an interval needs two seeds
            out.append(paired_table(f"paired_{key}_k{f}", f"{key} minus the comparator's, paired by seed, {sfx}: "
                                    "mean and 95% interval over data seeds (negative: fewer harmful behaviours than "
                                    "the comparator)", runs, method_rows, comparators, rate(key)))
    return out
