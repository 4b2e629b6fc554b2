"""How many records of a dropped-carry pool each IF-Guide document rule ties: the harmonic
rule thresholding every position (prompt and chat template included), the harmonic rule
thresholding the response tokens only, and the document sum. One pool of the project's
builder (:func:`prism_select.evaluation.carry.build`), its counterfactual target pairs,
two ``score`` runs (the harmonic rule under both thresholds; the sum is each run's
``token_sum`` column), ties as :func:`prism_select.baselines.ifguide.ties` counts them.

    python experiments/ifguide_ties.py OUT_DIR [--model default] [--pool-size 600]
        [--harmful-ratio 0.2] [--seed 0] [--curvature identity] [--json ties.json]

No network: ``--model default`` is the embedded SmolLM2-135M (GGUF).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from prism_select.baselines.ifguide import ties
from prism_select.curvature import CurvatureSettings
from prism_select.evaluation import carry
from prism_select.evaluation.experiment import read_jsonl
from prism_select.model import ModelSettings
from prism_select.pipeline import ScoreSettings, score_pool


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", default="default")
    ap.add_argument("--pool-size", type=int, default=600)
    ap.add_argument("--harmful-ratio", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--curvature", default="identity")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    data = carry.build(a.seed, pool_size=a.pool_size, harmful_ratio=a.harmful_ratio, carry_share=0.5, n_probes=8,
                       n_capability=8, n_counterfactual=16, n_warmup=0)
    pool = _write(a.out / "pool.jsonl", [{"id": r["id"], "prompt": r["prompt"], "response": r["response"]}
                                         for r in data["pool"]])
    targets = _write(a.out / "targets.jsonl", [{"prompt": t["prompt"], "chosen": t["chosen"],
                                                "rejected": t["rejected"]} for t in data["targets"]])
    model = ModelSettings(model=a.model, device="cpu", dtype="float32")
    out = {"pool_size": a.pool_size, "harmful_ratio": a.harmful_ratio, "seed": a.seed, "model": a.model,
           "curvature": a.curvature, "rules": {}}
    for tokens in ("all", "response"):
        t0 = time.perf_counter()
        run = a.out / f"harmonic-{tokens}"
        summary = score_pool(model, pool, targets, run,
                             ScoreSettings(method="ifguide", batch_size=a.batch_size, max_length=64, progress=False,
                                           method_options={"ranking": "harmonic", "threshold_tokens": tokens}),
                             CurvatureSettings(kind=a.curvature))
        rows = read_jsonl(run / "scores.jsonl")
        info = summary["method_info"]
        out["rules"][f"harmonic ({tokens} tokens)"] = {
            **ties(torch.tensor([r["score"] for r in rows], dtype=torch.float64)),
            "records_above_tau": info["records_above_tau"], "tokens": info["tokens"], "seconds": time.perf_counter() - t0}
        out["rules"]["sum"] = ties(torch.tensor([r["token_sum"] for r in rows], dtype=torch.float64))
    for name, t in out["rules"].items():
        print(f"{name:28s} ties {t['tied']:4d} of {a.pool_size} ({100 * t['share']:.1f}%)")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
