"""The ranking protocol (the paper's Sec. 3): for every harmful ratio and seed, a
GSM8K mistake-math pool and target pairs (:mod:`.builders.gsm8k`), scored by every method
through :func:`prism_select.run.score_pool` (the model is loaded once); AUROC and
AUPRC of the ``harmful`` flag, computed from the written ``scores.jsonl`` and
``pool.jsonl``. Several target variants (e.g. counterfactual pairs alone, and with
distractor pairs) share each pool. The experiment directory: :mod:`.experiment`.
"""

from __future__ import annotations

from .builders.gsm8k import mistake_math_targets
from .config import config_to_dict
from .sections import RankingConfig
from .experiment import (Experiment, finish_experiment, load_start, mean_table, mistake_math_run, pct,
                         resolve_methods, score_methods, write_if_changed)


def ranking(config: RankingConfig, out_dir, *, overwrite: bool = False) -> dict:
    """The ranking protocol (module docstring); returns the content of results.json."""
    cfg = config
    exp = Experiment(out_dir, "ranking", cfg, overwrite)
    methods_all = resolve_methods(cfg.methods)
    lm = load_start(exp, cfg)
    runs = []
    for ratio in cfg.harmful_ratios:
        for seed in cfg.seeds:
            rdir, pool, pool_path = mistake_math_run(exp, cfg, ratio, seed)
            for variant in cfg.targets:
                vdir = rdir / variant.name
                vdir.mkdir(parents=True, exist_ok=True)
                targets = mistake_math_targets(
                    cfg.data.gsm8k_train, variant.n_counterfactual, seed, exclude=pool,
                    n_distractors=variant.n_distractors, keep_annotations=cfg.data.keep_annotations)
                targets_path = vdir / "targets.jsonl"
                write_if_changed(targets_path, targets)
                methods = resolve_methods(variant.methods) if variant.methods else methods_all
                res = score_methods(exp, lm, pool_path, targets_path, vdir, methods, seed)
                runs.append({
                    "setting": f"{variant.name} @ {pct(ratio)}%", "variant": variant.name,
                    "harmful_ratio": ratio, "seed": seed, "dir": exp.rel(vdir), "pool": exp.rel(pool_path),
                    "targets": exp.rel(targets_path), "label": "harmful", "n_pool": len(pool),
                    "n_harmful": sum(p["harmful"] for p in pool), "n_pairs": len(targets),
                    "n_distractors": variant.n_distractors, "methods": res,
                    "pi": (res.get("prism") or {}).get("pi")})
    row_keys = list(dict.fromkeys(m for r in runs for m in r["methods"]))

    def metric(name):
        return lambda run, m, st: (run["methods"].get(m) or {}).get(name)

    tables = [
        mean_table("auroc", "Ranking AUROC of the harmful flag (higher is better)", runs, row_keys, metric("auroc")),
        mean_table("auprc", "Ranking AUPRC of the harmful flag (chance = harmful ratio)", runs, row_keys,
                   metric("auprc")),
    ]
    results = {"protocol": "ranking", "config": config_to_dict(cfg), "methods": row_keys,
               "settings": tables[0]["columns"], "seeds": cfg.seeds, "runs": runs, "tables": tables,
               "model": {"fingerprint": lm.fingerprint, **{k: v for k, v in lm.source.items() if k != "versions"}}}
    return finish_experiment(exp, results)
