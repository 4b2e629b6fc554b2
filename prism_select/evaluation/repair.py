"""The repair protocol (the paper's App. B): LoRA SFT of the start model on the full
pool (the ``repair`` preset) -> greedy responses to probes before and after -> target
pairs ``(probe, chosen = post-SFT response, rejected = pre-SFT response)`` for the
probes whose verdict got worse (``pair_selection``) -> every method scores the pool at
the start model (``score_at: start``) or the fine-tuned one (``post``) -> AUROC -> the
top ``remove_fraction`` (default: the harmful ratio) is removed -> SFT again from the
same start -> probe error rate. Rows ``Start`` (no SFT) and ``Mixed`` (unfiltered SFT)
come with every setting; ``oracle: true`` adds the removal of exactly the harmful
records. The experiment directory: :mod:`.experiment`.
"""

from __future__ import annotations

import dataclasses

from ..io import atomic_write_jsonl
from . import builders
from .config import RepairConfig, config_to_dict
from .experiment import (Experiment, error_rate, finish_experiment, free_cuda_cache, load_start, mean_table,
                         mistake_math_run, pct, read_jsonl, resolve_methods, respond, score_methods,
                         train_adapter, write_if_changed)


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


def repair(config: RepairConfig, out_dir, *, overwrite: bool = False) -> dict:
    """The repair protocol (module docstring); returns the content of results.json."""
    from ..model import load_model
    cfg = config
    exp = Experiment(out_dir, "repair", cfg, overwrite)
    methods = resolve_methods(cfg.methods)
    lm = load_start(exp, cfg)
    runs = []
    for ratio in cfg.harmful_ratios:
        for seed in cfg.seeds:
            rdir, pool, pool_path = mistake_math_run(exp, cfg, ratio, seed)
            probes = builders.gsm8k_probes(cfg.probes.gsm8k_test, cfg.probes.n, seed)
            probes_path = rdir / "probes.jsonl"
            write_if_changed(probes_path, probes)
            run = {"setting": f"{pct(ratio)}%", "harmful_ratio": ratio, "seed": seed, "dir": exp.rel(rdir),
                   "pool": exp.rel(pool_path), "probes": exp.rel(probes_path), "label": "harmful",
                   "n_pool": len(pool), "n_harmful": sum(p["harmful"] for p in pool), "n_probes": len(probes),
                   "error_rates": {}, "methods": {}, "removed": {}}
            # 1. pre- and post-SFT responses
            pre = respond(exp, lm, probes_path, rdir / "start", cfg.probes.checker, "start")
            run["error_rates"]["Start"] = error_rate(pre)["error_rate"]
            mixed_adapter = train_adapter(exp, lm, pool_path, rdir / "mixed", seed, "mixed")
            post = respond(exp, mixed_adapter, probes_path, rdir / "mixed", cfg.probes.checker, "mixed")
            run["error_rates"]["Mixed"] = error_rate(post)["error_rate"]
            # 2. target pairs from the probes whose behaviour changed
            pairs = pairs_from_responses(probes, read_jsonl(pre), read_jsonl(post), cfg.pair_selection)
            run["pair_selection"] = cfg.pair_selection
            if len(pairs) < cfg.min_pairs and cfg.fallback_pair_selection:
                run["note"] = (f"{len(pairs)} pair(s) from {cfg.pair_selection} probes, fewer than min_pairs "
                               f"{cfg.min_pairs}: pairs from {cfg.fallback_pair_selection} probes used instead")
                run["pair_selection"] = cfg.fallback_pair_selection
                pairs = pairs_from_responses(probes, read_jsonl(pre), read_jsonl(post),
                                              cfg.fallback_pair_selection)
            targets_path = rdir / "targets.jsonl"
            write_if_changed(targets_path, pairs)
            run["targets"] = exp.rel(targets_path)
            run["n_pairs"] = len(pairs)
            pre_rows, post_rows = read_jsonl(pre), read_jsonl(post)
            run["n_worsened"] = sum(1 for a, b in zip(pre_rows, post_rows) if a["correct"] and not b["correct"])
            run["n_improved"] = sum(1 for a, b in zip(pre_rows, post_rows) if not a["correct"] and b["correct"])
            n_remove = builders.harmful_count(len(pool), cfg.remove_fraction if cfg.remove_fraction is not None
                                              else ratio)
            run["n_remove"] = n_remove
            if not pairs:
                run["note"] = (f"no probe qualified as a target pair ({run['pair_selection']}): "
                               "nothing to score; methods left out of this setting")
                runs.append(run)
                continue
            # 3. scores at the start (or post-SFT) model
            if cfg.score_at == "post":
                score_lm = load_model(dataclasses.replace(cfg.model, adapter=str(mixed_adapter)))
            else:
                score_lm = lm
            run["methods"] = score_methods(exp, score_lm, pool_path, targets_path, rdir, methods, seed)
            if score_lm is not lm:
                del score_lm
                free_cuda_cache()
            run["pi"] = (run["methods"].get("prism") or {}).get("pi")
            # 4. filter and retrain
            rows = list(methods)
            if cfg.oracle:
                rows.append("Oracle")
            harmful_ids = {p["id"] for p in pool if p["harmful"]}
            for m in rows:
                if m != "Oracle" and run["methods"].get(m, {}).get("status") != "ok":
                    continue
                mdir = rdir / "retrain" / m
                mdir.mkdir(parents=True, exist_ok=True)
                kept_path = mdir / "kept.jsonl"
                if m == "Oracle":
                    oracle_scores = mdir / "oracle_scores.jsonl"
                    ranked = sorted(pool, key=lambda p: (not p["harmful"], p["id"]))
                    atomic_write_jsonl(oracle_scores, ({"id": p["id"], "score": float(p["harmful"]), "rank": i + 1}
                                                       for i, p in enumerate(ranked)))
                    rem = _remove_top(oracle_scores, pool_path, kept_path, n_remove)
                else:
                    rem = _remove_top(exp.out / run["methods"][m]["dir"] / "scores.jsonl", pool_path, kept_path,
                                      n_remove)
                run["removed"][m] = {"n": len(rem["removed"]),
                                     "harmful": sum(1 for i in rem["removed"] if i in harmful_ids)}
                if not cfg.retrain:
                    continue
                adapter = train_adapter(exp, lm, kept_path, mdir, seed, f"retrain:{m}")
                resp = respond(exp, adapter, probes_path, mdir, cfg.probes.checker, f"retrain:{m}")
                run["error_rates"][m] = error_rate(resp)["error_rate"]
            runs.append(run)
    method_rows = list(dict.fromkeys(m for r in runs for m in r["methods"]))
    err_rows = ["Start", "Mixed"] + method_rows + (["Oracle"] if cfg.oracle else [])

    def auroc_of(run, m, st):
        return (run["methods"].get(m) or {}).get("auroc")

    def err_of(run, m, st):
        return run["error_rates"].get(m)

    def removed_of(run, m, st):
        r = run["removed"].get(m)
        return None if not r or not run["n_harmful"] else r["harmful"] / run["n_harmful"]

    tables = [
        mean_table("auroc", f"Ranking AUROC of the harmful flag, pairs from {cfg.pair_selection} probes"
                   + (f" (else {cfg.fallback_pair_selection})" if cfg.fallback_pair_selection else "")
                   + f", scored at the {cfg.score_at} model", runs, method_rows, auroc_of),
        mean_table("error_rate", "Probe error rate after filtering and retraining (lower is better)", runs,
                   err_rows, err_of, lower_is_better=True,
                   note="Start: the start model; Mixed: SFT on the unfiltered pool"),
        mean_table("harmful_removed", "Recall of the removal: harmful records removed / all harmful records",
                   runs, method_rows + (["Oracle"] if cfg.oracle else []), removed_of),
    ]
    results = {"protocol": "repair", "config": config_to_dict(cfg), "methods": method_rows,
               "settings": tables[0]["columns"], "seeds": cfg.seeds, "runs": runs, "tables": tables,
               "model": {"fingerprint": lm.fingerprint, **{k: v for k, v in lm.source.items() if k != "versions"}}}
    return finish_experiment(exp, results)
