"""Which BIG-Bench-Hard tasks the embedded model learns from a selection-sized SFT.

A general-selection testbed can only tell selectors apart on a target task that the model
learns from about as many records as the budget holds. For each task: a seeded split of
its examples into ``--n-train`` SFT records (prompt = input, response = the reference
answer) and ``--n-probes`` held-out probes; the start model and the models after LoRA SFT
(general_select.yaml's settings) answer the probes greedily; checker ``leading_answer``.
One SFT per ``--wrong-shares`` value: that share of the SFT records answers wrong
(``builders.bbh.wrong_answer``), so 0 is the best a selection of the task can be and 0.3 what a
selector that only finds the task gets from general_select.yaml's pool. Per task and share:
accuracy, accuracy balanced over the reference answers, and the majority-answer floor. A
task where the shares train alike leaves a selector nothing to gain within the task.

    python experiments/task_learnability.py --bbh ../shared/data/bbh --tasks boolean_expressions web_of_lies \
        --json out.json [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from prism_select.evaluation.builders.bbh import wrong_answer
from prism_select.evaluation.experiment import adapted, majority_answer_floor
from prism_select.finetune import FinetuneSettings, finetune
from prism_select.evaluation.probes import generate, leading_answer
from prism_select.io import atomic_write_jsonl
from prism_select.model import ModelSettings, load_model

#: general_select.yaml's SFT of a selection
SFT = dict(learning_rate=1.0e-4, epochs=3, batch_size=8, grad_accum=1, max_length=400, progress=False)


def _scores(probes: list, responses: list) -> dict:
    right = [leading_answer(p, r) for p, r in zip(probes, responses)]
    by: dict = {}
    for p, ok in zip(probes, right):
        by.setdefault(p["reference"], []).append(ok)
    first = {}
    for r in responses:
        w = (r.strip().split() or [""])[0].strip(".,:;!").lower()
        first[w] = first.get(w, 0) + 1
    return {"accuracy": sum(right) / len(right), "balanced": sum(sum(v) / len(v) for v in by.values()) / len(by),
            "first_words": dict(sorted(first.items(), key=lambda kv: -kv[1])[:4])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bbh", required=True, help="folder of BBH task files (TASK.json)")
    ap.add_argument("--tasks", nargs="+", required=True)
    ap.add_argument("--n-train", type=int, default=44)
    ap.add_argument("--n-probes", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--wrong-shares", nargs="+", type=float, default=[0.0, 0.3])
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    lm = load_model(ModelSettings(model="default", dtype="float32", device=a.device))
    rows = []
    for task in a.tasks:
        t0 = time.perf_counter()
        data = json.loads(Path(a.bbh, f"{task}.json").read_text())
        ex = data.get("examples", data)
        ex = [dict(e, _i=i) for i, e in enumerate(ex)]
        random.Random(a.seed).shuffle(ex)
        train, probes = ex[:a.n_train], ex[a.n_train:a.n_train + a.n_probes]
        probes = [{"id": f"{task}-{e['_i']}", "prompt": e["input"], "reference": e["target"], "task": task}
                  for e in probes]
        prompts = [p["prompt"] for p in probes]
        start = generate(lm, prompts, max_new_tokens=a.max_new_tokens, batch_size=64)
        answer_set = sorted({str(e["target"]).strip() for e in ex})
        after = {}
        for share in a.wrong_shares:
            rng = random.Random(a.seed * 1000 + round(share * 100))
            wrong = set(rng.sample(range(len(train)), round(share * len(train))))
            records = [{"id": f"{task}-{e['_i']}", "prompt": e["input"],
                        "response": wrong_answer(e, answer_set, rng) if i in wrong else e["target"]}
                       for i, e in enumerate(train)]
            with tempfile.TemporaryDirectory() as tmp:
                pool = Path(tmp) / "train.jsonl"
                atomic_write_jsonl(pool, records)
                res = finetune(lm, pool, Path(tmp) / "sft", FinetuneSettings.preset("general", seed=a.seed, **SFT),
                               overwrite=True)
                with adapted(lm, Path(res.adapter_dir)) as m:
                    after[str(share)] = _scores(probes, generate(m, prompts, max_new_tokens=a.max_new_tokens,
                                                                 batch_size=64))
        acc, _ = majority_answer_floor(probes)
        row = {"task": task, "n_train": len(train), "n_probes": len(probes),
               "answers": len({p["reference"] for p in probes}), "majority": acc["mean"],
               "start": _scores(probes, start), "after_sft_by_wrong_share": after,
               "seconds": round(time.perf_counter() - t0, 1)}
        rows.append(row)
        print(f"{task}: start {row['start']['accuracy']:.2f} (balanced {row['start']['balanced']:.2f}); majority "
              f"{acc['mean']:.2f}, {row['answers']} answers; after SFT on {len(train)}, by wrong share: "
              + "; ".join(f"{k}: {v['accuracy']:.2f} (balanced {v['balanced']:.2f}, {v['first_words']})"
                          for k, v in after.items()) + f" ({row['seconds']} s)", flush=True)
        if a.json:
            Path(a.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "device": str(lm.device),
                                                "seed": a.seed, "sft": SFT, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
