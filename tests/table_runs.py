"""Experiment folders as `prism-select experiment repair` and `experiment select` leave them,
made without a model: seeded scores, kept sets, judged responses and step records, some rows
unfinished. The inputs of the results-table tests (``tests/evaluation/test_tables.py``)."""

import json
import random
from pathlib import Path

from prism_select.evaluation import carry
from prism_select.evaluation.repair import retrain_dir

#: the start model's fingerprint in the step records; a retraining of another model is left out
MODEL = "m" * 16
OTHER_MODEL = "o" * 16


def _jsonl(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _scores(path: Path, pool: list, rng: random.Random, extra: str | None = None) -> list:
    """A seeded ``scores.jsonl`` (harmful records a little higher); the ids, best first."""
    sc = {r["id"]: rng.random() + (0.4 if r.get("harmful") or r.get("mislabeled") else 0.0) for r in pool}
    order = sorted(sc, key=lambda i: -sc[i])
    rows = [{"id": i, "score": sc[i], "rank": order.index(i) + 1} for i in sc]
    if extra:
        for r in rows:
            r[extra] = round(rng.random(), 6)
    _jsonl(path, rows)
    return order


def _answers(d: Path, probes: list, rng: random.Random, finished: bool = True, model: str = MODEL,
             behaviour: bool = True) -> None:
    """Judged responses to ``probes`` (a carry dropped, one added, no number or right) and
    the behaviour measurement, with the step records of a finished retraining."""
    rows = []
    for p in probes:
        true = p["a"] + p["b"]
        got = rng.choice([true, true, true - 10, true + 10, None])
        rows.append({"id": p["id"], "task": p["task"], "correct": got == true,
                     "response": f"{p['a']} + {p['b']} = {got}." if got is not None else "I cannot say."})
    _jsonl(d / "responses.jsonl", rows)
    if behaviour:
        (d / "behaviour.json").write_text(json.dumps({"harmful_answer_rate": round(rng.random(), 4),
                                                      "harmful_preference": round(rng.random(), 4)}))
    if finished:
        (d / ".responses-step.json").write_text("{}")
        (d / ".retrain-step.json").write_text(json.dumps({"model": model}))


def repair_run(out: Path, seeds=(0, 1), finetune_seeds=(0, 1), fractions=(10, 20),
               methods=("prism", "random", "ifguide"), partial_oracles=(50,)) -> Path:
    """A dropped-carry repair experiment (``experiments/dropped_carry.yaml``'s layout):
    per data seed the pool, probes and counterfactual targets of the family's builder,
    Start and Mixed, the Oracle and partial Oracles, each method's scores (IF-Guide with a
    ``token_sum`` column) and top-k removals, and their retrainings per fine-tuning seed
    (``finetune_seeds=None``: one retraining per kept set, Mixed not retrained). Seed 1's
    random retraining at the last fraction is cut short, and one of seed 0's retrainings
    started from another model."""
    for seed in seeds:
        rng = random.Random(1000 + seed)
        data = carry.build(seed, pool_size=20, harmful_ratio=0.2, carry_share=0.5, n_probes=4, n_capability=4,
                           n_counterfactual=4, n_warmup=0)
        sd = out / "runs" / "r20" / f"seed{seed}"
        pool, probes = data["pool"], data["probes"]
        _jsonl(sd / "pool.jsonl", pool)
        _jsonl(sd / "probes.jsonl", probes)
        vdir = sd / "probes"
        _jsonl(vdir / "targets.jsonl", data["targets"])
        _answers(sd / "start", probes, rng)
        (sd / "mixed").mkdir(parents=True, exist_ok=True)
        (sd / "mixed" / ".finetune-step.json").write_text(json.dumps({"model": MODEL}))
        kept = {"mixed": sd / "pool.jsonl"}
        harmless = [r for r in pool if not r["harmful"]]
        kept["oracle"] = _jsonl(sd / "oracle" / "kept.jsonl", harmless)
        harmful = [r for r in pool if r["harmful"]]
        for q in partial_oracles:
            drop = {r["id"] for r in harmful[:round(q / 100 * len(harmful))]}
            kept[f"oracle-{q}"] = _jsonl(sd / f"oracle-{q}" / "kept.jsonl", [r for r in pool if r["id"] not in drop])
        for m in methods:
            mdir = vdir / "scores" / m
            order = _scores(mdir / "scores.jsonl", pool, rng, "token_sum" if m == "ifguide" else None)
            (mdir / "run.json").write_text(json.dumps({"method": m, "pi": {"min": 0.1, "mean": 0.4 + seed / 10,
                                                                            "max": 0.9}, "timings": {"total_s": 1.5}}))
            if m == "prism":
                _jsonl(mdir / "pairs.jsonl", [{"pi": round(0.2 + 0.1 * i, 3)} for i in range(len(data["targets"]))])
            for f in fractions:
                drop = set(order[:round(f / 100 * len(pool))])
                kept[f"k{f}/{m}"] = _jsonl(vdir / "removal" / f"k{f}" / m / "kept.jsonl",
                                           [r for r in pool if r["id"] not in drop])
        for name, path in kept.items():
            if name == "mixed" and not finetune_seeds:
                _answers(sd / "mixed", probes, rng)
                continue
            for ft in (finetune_seeds or [None]):
                d = retrain_dir(sd, path, ft)
                if d.is_dir():
                    continue  # a removal keeping another row's records shares its retraining
                cut = (seed, name) == (1, f"k{fractions[-1]}/random")
                other = (seed, name, ft) == (0, f"k{fractions[0]}/random", (finetune_seeds or [None])[-1])
                _answers(d, probes, rng, finished=not cut, model=OTHER_MODEL if other else MODEL)
    return out


def select_run(out: Path, seeds=(0, 1), methods=("prism", "equal", "ifguide", "random"), task: str = "carry",
               fraction: float = 0.05) -> Path:
    """A one-task select experiment (``experiments/carry_select_cpu.yaml``'s layout): per
    seed a pool of the target task (30% answering wrong, ``mislabeled``) and two others,
    held-out probes with reference answers, Start and Full-data responses, the Task-records
    floors' and each method's scores and selections, and each selection's responses; seed
    1's ``ifguide`` selection is not fine-tuned yet."""
    for seed in seeds:
        rng = random.Random(2000 + seed)
        sd = out / "runs" / f"seed{seed}"
        pool = []
        for i in range(60):
            t = task if i < 20 else ("sports" if i < 40 else "dates")
            wrong = t == task and i % 10 < 3
            pool.append({"id": f"r{i}", "task": t, "prompt": f"q{i}", "response": rng.choice(["Yes", "No", "Maybe"]),
                         "mislabeled": wrong})
        _jsonl(sd / "pool.jsonl", pool)
        heldout = [{"id": f"h{i}", "task": task, "prompt": f"h{i}", "reference": ["Yes", "No"][i % 2]}
                   for i in range(10)]
        _jsonl(sd / "heldout.jsonl", heldout)
        _jsonl(sd / "targets.jsonl", [{"id": f"t{i}", "task": task, "prompt": "p", "chosen": "a", "rejected": "b"}
                                      for i in range(4)])

        def judged(d: Path):
            _jsonl(d / "responses.jsonl", [{**h, "correct": rng.random() < 0.6,
                                            "response": rng.choice(["Yes", "No. ok", "maybe"])} for h in heldout])
        judged(sd / "start")
        judged(sd / "full")
        k = round(fraction * len(pool))
        rows = {"Task records": sd / "floors" / "task_records", "Task records, right only":
                sd / "floors" / "task_records_right", **{m: sd / "scores" / m for m in methods}}
        for m, sdir in rows.items():
            order = _scores(sdir / "scores.jsonl", pool, rng)
            if m in methods:
                (sdir / "run.json").write_text(json.dumps({"method": m, "timings": {"total_s": 2.25, "fit_s": 1.0},
                                                           "curvature": {"split_half": {"choice": "ekfac"}}}))
            chosen = [next(r for r in pool if r["id"] == i) for i in order[:k]]
            _jsonl(sd / "selected" / m / "subset.jsonl", chosen)
            if (seed, m) != (1, "ifguide"):
                judged(sd / "selected" / m)
    return out
