"""How much the precision of ``v`` itself moves the ranking, and which part of it (CPU or GPU).

``--precision split32`` makes the *scores* float32-accurate for a given ``v``. This script
computes ``v = H^-1 g_KL`` on the embedded model from the bf16 weights in bf16 arithmetic
(``--precision model``), in split32's arithmetic, and from the same weights in float32, and
mixes the parts: each ``v`` (bf16, split32 or float32 ``g_KL`` and EK-FAC fit, and ``g_KL``
from one batch, which removes the accumulation across batches in bf16 ``.grad``) scores the pool with
float32 exact scoring and is compared with the all-float32 ``v``:

    python benchmarks/v_precision.py --pool benchdata/gsm8k_1100.jsonl --n 128 --targets 16 --json out.json

Prints the relative errors of ``g_KL`` and ``v``, Spearman / top-5% overlap / relative
error of each ranking, and the default pipeline (bf16 ``v``, bf16 scores) and the
``--precision split32`` one (its ``g_KL``, fit and scores) against the all-float32 one.
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
from bench_scoring import accuracy, gsm8k_targets, load_embedded, read_gsm8k  # noqa: E402

from prism_select.curvature import CurvatureSettings, fit_curvature  # noqa: E402
from prism_select.data.tokenize import encode  # noqa: E402
from prism_select.model import tracked_linear_modules  # noqa: E402
from prism_select.engine.policy import direction_policy  # noqa: E402
from prism_select.preference import DIRECTION_KERNELS, compute_preference  # noqa: E402
from prism_select.runtime.execution import ExecutionContext  # noqa: E402
from prism_select.scoring import score_encoded  # noqa: E402


def direction(model, chosen, rejected, pad_id, batch, precision="model"):
    mods = tracked_linear_modules(model)
    with direction_policy(model, ExecutionContext.of(model, precision=precision)):
        return compute_preference(model, mods, chosen, rejected, pad_id=pad_id, batch_size=batch,
                                  execution=ExecutionContext.of(
                                      model, progress=False, kernels=DIRECTION_KERNELS)).direction


def fit(model, fit_enc, pad_id, batch, dev, precision="model"):
    mods = tracked_linear_modules(model)
    return fit_curvature(model, mods, fit_enc, CurvatureSettings(kind="ekfac", batch_size=batch), pad_id=pad_id,
                         execution=ExecutionContext.of(model, dev, progress=False, cuda_graphs="off",
                                                       precision=precision))


def rel_err(a: dict, ref: dict) -> float:
    num = sum(float((a[n].double() - ref[n].double()).norm() ** 2) for n in ref)
    return (num / sum(float(ref[n].double().norm() ** 2) for n in ref)) ** 0.5


def exact_scores(model, V, enc, pad_id, batch, dev, precision="model"):
    """The library's exact scores (input order, float64) under ``precision``."""
    return score_encoded(model, tracked_linear_modules(model), enc, {n: t.to(dev) for n, t in V.items()},
                         pad_id=pad_id, batch_size=batch,
                         execution=ExecutionContext.of(model, progress=False, cuda_graphs="off",
                                                       precision=precision)).double().cpu()


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
    # g_KL: bf16 in batches (the pipeline: accumulated across batches in bf16 .grad), bf16 in
    # one batch (no accumulation across batches), float32
    g16 = direction(model, chosen, rejected, pad_id, a.batch)
    g16_one = direction(model, chosen, rejected, pad_id, len(chosen))
    g32 = direction(m32, chosen, rejected, pad_id, a.batch)
    g_split = direction(model, chosen, rejected, pad_id, a.batch, "split32")  # as --precision split32
    c16, c32 = fit(model, enc, pad_id, a.batch, dev), fit(m32, enc, pad_id, a.batch, dev)
    c_split = fit(model, enc, pad_id, a.batch, dev, "split32")  # the fit as --precision split32 runs it
    pre = lambda c, g: {n: t.double() for n, t in c.precondition(g).items()}  # noqa: E731
    v32 = pre(c32, g32)
    vs = {"bf16 g_KL, bf16 fit (pipeline, --precision model)": pre(c16, g16),
          "float32 g_KL, bf16 fit": pre(c16, g32),
          "bf16 g_KL, float32 fit": pre(c32, g16),
          "bf16 g_KL in one batch, bf16 fit": pre(c16, g16_one),
          "float32 g_KL, split32 fit": pre(c_split, g32),
          "split32 g_KL and fit (--precision split32)": pre(c_split, g_split)}
    s_v32 = exact_scores(m32, v32, enc, pad_id, a.batch, dev)       # float32 scores, float32 v
    res = {"device": str(dev), "n": len(enc), "targets": len(chosen),
           "g_kl_rel_err": {"bf16 (batches)": rel_err(g16, g32), "bf16 (one batch)": rel_err(g16_one, g32),
                            "split32": rel_err(g_split, g32)},
           "v_rel_err": {}, "float32_scores_vs_float32_v": {}}
    for name, v in vs.items():
        res["v_rel_err"][name] = rel_err(v, v32)
        res["float32_scores_vs_float32_v"][name] = accuracy(s_v32, exact_scores(m32, v, enc, pad_id, a.batch, dev))
    s_default = exact_scores(model, vs["bf16 g_KL, bf16 fit (pipeline, --precision model)"], enc, pad_id, a.batch, dev)
    res["default_pipeline_vs_all_float32"] = accuracy(s_v32, s_default)
    v_split = vs["split32 g_KL and fit (--precision split32)"]
    s_split = exact_scores(model, v_split, enc, pad_id, a.batch, dev, "split32")
    res["split32_pipeline_vs_all_float32"] = accuracy(s_v32, s_split)
    res["seconds"] = time.perf_counter() - t
    print(json.dumps(res, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps({**res, "argv": sys.argv, "torch": torch.__version__}, indent=1))


if __name__ == "__main__":
    main()
