"""How much the precision of ``v`` itself moves the ranking (CPU or GPU).

``--precision`` (split32) makes the *scores* float32-accurate for a given ``v``; ``v``
(``g_KL`` and the EK-FAC fit) is still computed in the model's dtype. This script computes
``v`` twice on the embedded model, from the bf16 weights in bf16 arithmetic (what the
pipeline does) and from the same weights in float32, and scores the pool with float32
exact scoring under both, so the only difference is ``v``:

    python benchmarks/v_precision.py --pool benchdata/gsm8k_1100.jsonl --n 128 --targets 16 --json out.json

Prints Spearman / top-5% overlap / relative error between the two rankings, and of the
default pipeline (bf16 ``v``, bf16 scores) against the all-float32 one.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_scoring import accuracy, batches_of, gsm8k_targets, load_embedded, read_gsm8k  # noqa: E402

from prism_select.curvature import CurvatureSettings, fit_curvature  # noqa: E402
from prism_select.data.tokenize import encode  # noqa: E402
from prism_select.fast import ExactScorer, collate_to  # noqa: E402
from prism_select.model import tracked_linear_modules  # noqa: E402
from prism_select.preference import compute_preference  # noqa: E402


def direction_v(model, chosen, rejected, fit_enc, pad_id, batch, dev):
    mods = tracked_linear_modules(model)
    pref = compute_preference(model, mods, chosen, rejected, pad_id=pad_id, batch_size=batch, progress=False)
    cur = fit_curvature(model, mods, fit_enc, CurvatureSettings(kind="ekfac", batch_size=batch), pad_id=pad_id,
                        device=dev, progress=False, cuda_graphs="off")
    return {n: t.double() for n, t in cur.precondition(pref.direction).items()}


def exact_scores(model, V, enc, pad_id, batch, dev):
    mods = tracked_linear_modules(model)
    out = torch.full((len(enc),), float("nan"), dtype=torch.float64)
    with ExactScorer(model, mods, {n: t.to(dev) for n, t in V.items()}) as sc:
        for b in batches_of(enc, batch):
            out[b] = sc.score(collate_to([enc[i] for i in b], pad_id, dev)).double().cpu()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pool", required=True, help="GSM8K-style jsonl (question/answer)")
    ap.add_argument("--n", type=int, default=128, help="records scored (and used for the EK-FAC fit)")
    ap.add_argument("--targets", type=int, default=16, help="target pairs, read after the scored records")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device)
    model, tok = load_embedded(dev, torch.bfloat16)
    pad_id = tok.pad_token_id
    recs = read_gsm8k(a.pool, a.n, tok, 512)
    enc = [encode(tok, r["question"], r["answer"], 512) for r in recs]
    chosen, rejected = gsm8k_targets(read_gsm8k(a.pool, a.targets, tok, 512, offset=a.n), tok, 512)
    m32 = copy.deepcopy(model).float()
    t = time.perf_counter()
    v16 = direction_v(model, chosen, rejected, enc, pad_id, a.batch, dev)
    v32 = direction_v(m32, chosen, rejected, enc, pad_id, a.batch, dev)
    v_err = (sum(float((v16[n] - v32[n]).norm() ** 2) for n in v32) / sum(float(v32[n].norm() ** 2) for n in v32)) ** 0.5
    s_v16 = exact_scores(m32, v16, enc, pad_id, a.batch, dev)      # float32 scores, bf16 v
    s_v32 = exact_scores(m32, v32, enc, pad_id, a.batch, dev)      # float32 scores, float32 v
    s_default = exact_scores(model, v16, enc, pad_id, a.batch, dev)  # the default pipeline: bf16 v, bf16 scores
    res = {"device": str(dev), "n": len(enc), "targets": len(chosen), "seconds": time.perf_counter() - t,
           "v_rel_err": v_err,
           "float32_scores_bf16_v_vs_float32_v": accuracy(s_v32, s_v16),
           "default_pipeline_vs_all_float32": accuracy(s_v32, s_default),
           "bf16_scores_vs_float32_scores_same_bf16_v": accuracy(s_v16, s_default)}
    print(json.dumps(res, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps({**res, "argv": sys.argv, "torch": torch.__version__}, indent=1))


if __name__ == "__main__":
    main()
