"""Can the EK-FAC eigenbases be kept (cached, or held in host memory) in bf16?

Fits EK-FAC on the embedded model in float32 and preconditions PRISM's ``g_KL`` with the
eigenbases ``Q_A``, ``Q_S`` as fitted (float32) and rounded to bf16 (and, separately, the
corrected eigenvalues ``Lambda`` rounded to bf16); each ``v`` scores the records with the
library's float32 exact scoring and is compared with the float32 one (relative error of
``v``, Spearman, top-5% overlap, relative error of the scores). CPU or GPU.

    python benchmarks/eigenbasis_dtype.py --pool benchdata/gsm8k_1100.jsonl --n 128 --targets 16 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_scoring import accuracy, gsm8k_targets, load_embedded, read_gsm8k  # noqa: E402
from v_precision import exact_scores, rel_err  # noqa: E402

from prism_select.curvature import Curvature, CurvatureSettings, fit_curvature  # noqa: E402
from prism_select.runtime.execution import ExecutionContext  # noqa: E402
from prism_select.data.tokenize import encode  # noqa: E402
from prism_select.model import tracked_linear_modules  # noqa: E402
from prism_select.preference import DIRECTION_KERNELS, compute_preference  # noqa: E402


def rounded(cur: Curvature, suffixes: tuple, dtype=torch.bfloat16) -> Curvature:
    """The same curvature with the tensors ending in ``suffixes`` rounded to ``dtype``."""
    t = {k: (v.to(dtype).to(v.dtype) if k.endswith(suffixes) else v) for k, v in cur.tensors.items()}
    return Curvature(cur.kind, cur.layers, t, cur.damping)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pool", required=True, help="GSM8K-style jsonl (question/answer)")
    ap.add_argument("--n", type=int, default=128, help="records fitted on and scored")
    ap.add_argument("--targets", type=int, default=16, help="target pairs, read after the scored records")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--json")
    a = ap.parse_args()
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device)
    t0 = time.perf_counter()
    model, tok = load_embedded(dev, torch.float32)
    pad = tok.pad_token_id
    recs = read_gsm8k(a.pool, a.n, tok, 512)
    enc = [encode(tok, r["question"], r["answer"], 512) for r in recs]
    chosen, rejected = gsm8k_targets(read_gsm8k(a.pool, a.targets, tok, 512, offset=a.n), tok, 512)
    mods = tracked_linear_modules(model)
    g = compute_preference(model, mods, chosen, rejected, pad_id=pad, batch_size=a.batch,
                           execution=ExecutionContext.of(model, progress=False, kernels=DIRECTION_KERNELS)).direction
    cur = fit_curvature(model, mods, enc, CurvatureSettings(kind="ekfac", batch_size=a.batch), pad_id=pad,
                        execution=ExecutionContext.of(model, dev, progress=False, cuda_graphs="off"))
    v32 = cur.precondition(g)
    ref = exact_scores(model, v32, enc, pad, a.batch, dev)
    res = {"device": str(dev), "n": len(enc), "targets": len(chosen), "rows": {}}
    for name, suffixes in (("eigenbases Q_A, Q_S in bf16", ("::QA", "::QS")),
                           ("eigenvalues Lambda in bf16", ("::Lambda",)),
                           ("Q_A, Q_S and Lambda in bf16", ("::QA", "::QS", "::Lambda"))):
        v = rounded(cur, suffixes).precondition(g)
        res["rows"][name] = {"v_rel_err": rel_err(v, v32), **accuracy(ref, exact_scores(model, v, enc, pad, a.batch, dev))}
        print(name, json.dumps(res["rows"][name]), flush=True)
        res["seconds"] = time.perf_counter() - t0
        if a.json:  # after every row: a run stopped by a time limit keeps what it measured
            Path(a.json).write_text(json.dumps({**res, "argv": sys.argv, "torch": torch.__version__}, indent=1))


if __name__ == "__main__":
    main()
