"""How many records of a dropped-carry pool each IF-Guide document rule ties: the harmonic
rule thresholding every position (prompt and chat template included), the harmonic rule
thresholding the response tokens only, and the document sum. One pool of the project's
builder (:func:`prism_select.evaluation.carry.build`), its counterfactual target pairs as
the targets, the run's tracked layers, identity curvature (the direction ``V = g``: ties
come from the rule, not from the preconditioning); one pass of token scores
(:func:`prism_select.methods.ifguide.token_scores`, ``position`` attribution) ranked the
three ways, ties as :func:`prism_select.methods.ifguide.ties` counts them.

    python experiments/ifguide_ties.py [--model default] [--pool-size 600] [--harmful-ratio 0.2]
        [--seed 0] [--json ties.json]

No network: ``--model default`` is the embedded SmolLM2-135M (GGUF).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from prism_select.methods.ifguide import (contrastive_target, ifguide_rank, response_token_scores, ties,
                                            token_scores)
from prism_select.data.tokenize import encode
from prism_select.evaluation import carry
from prism_select.model import ModelSettings, load_model, tracked_linear_modules


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--pool-size", type=int, default=600)
    ap.add_argument("--harmful-ratio", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-length", type=int, default=64)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    data = carry.build(a.seed, pool_size=a.pool_size, harmful_ratio=a.harmful_ratio, carry_share=0.5, n_probes=8,
                       n_capability=8, n_counterfactual=16, n_warmup=0)
    lm = load_model(ModelSettings(model=a.model, device="cpu", dtype="float32"))
    tok = lm.tokenizer
    pool = [encode(tok, r["prompt"], r["response"], a.max_length) for r in data["pool"]]
    chosen = [encode(tok, t["prompt"], t["chosen"], a.max_length) for t in data["targets"]]
    rejected = [encode(tok, t["prompt"], t["rejected"], a.max_length) for t in data["targets"]]
    modules = tracked_linear_modules(lm.model, None)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    g, _, _ = contrastive_target(lm.model, modules, chosen, rejected, pad_id=pad, batch_size=a.batch_size)
    ts = token_scores(lm.model, modules, pool, g, pad_id=pad, batch_size=a.batch_size, progress=True)
    resp = response_token_scores(ts, pool, "position")
    rules = {"harmonic (every position)": ifguide_rank(ts, 0.99, "harmonic"),
             "harmonic (response tokens)": ifguide_rank(resp, 0.99, "harmonic"),
             "sum": ifguide_rank(ts, 0.99, "sum")}
    out = {"pool_size": a.pool_size, "harmful_ratio": a.harmful_ratio, "seed": a.seed, "model": a.model,
           "curvature": "identity", "tokens": {"every position": sum(len(t) for t in ts),
                                               "response": sum(len(t) for t in resp)},
           "seconds": round(time.perf_counter() - t0, 1),
           "rules": {k: ties(v) for k, v in rules.items()}}
    for name, t in out["rules"].items():
        print(f"{name:28s} ties {t['tied']:4d} of {a.pool_size} ({100 * t['share']:.1f}%)")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
