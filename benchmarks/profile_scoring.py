"""Where a scoring route's GPU time goes: kernel time by operator for a few eager
batches of the exact route under each precision policy, side by side.

    python benchmarks/profile_scoring.py --pool benchdata/gsm8k_1100.jsonl --precisions model,split32

Runs on the embedded model (``PRISM_SELECT_DEFAULT_GGUF`` or the cached default), or a
random-init ``--config`` of ``bench_scoring.py``, with a random direction: the kernels and their cost do not depend on ``v``. Prints, per policy,
the operators with the most CUDA time and the total, and writes JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_scoring import batches_of, build_random, load_embedded, random_data, read_gsm8k  # noqa: E402

from prism_select.data.tokenize import encode  # noqa: E402
from prism_select.engine import collate_to  # noqa: E402
from prism_select.model import tracked_linear_modules  # noqa: E402
from prism_select.scoring import make_scorer  # noqa: E402
from prism_select.runtime.execution import ExecutionContext  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="embedded", help="embedded (GSM8K text) or a bench_scoring.py config")
    ap.add_argument("--pool", default=None, help="embedded: GSM8K-style jsonl (question/answer)")
    ap.add_argument("--seq-len", type=int, default=512, help="random configs: tokens per example")
    ap.add_argument("--precisions", default="model,residual32,split32")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--batches", type=int, default=6, help="profiled batches per policy (after 2 warm-up)")
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_scoring.py needs a CUDA device")
    from torch.profiler import ProfilerActivity, profile
    dev = torch.device("cuda")
    n = a.batch * (a.batches + 2)
    if a.config == "embedded":
        model, tok = load_embedded(dev, torch.bfloat16)
        recs = read_gsm8k(a.pool, n, tok, 512)
        enc, pad = [encode(tok, r["question"], r["answer"], 512) for r in recs], tok.pad_token_id
    else:
        model, _ = build_random(a.config, torch.bfloat16, dev, a.seq_len)
        enc, pad = random_data(n, a.seq_len, model.config.vocab_size, 0.0), 0
    batches = [collate_to([enc[i] for i in b], pad, dev) for b in batches_of(enc, a.batch)]
    mods = tracked_linear_modules(model)
    g = torch.Generator().manual_seed(0)
    V = {n: (torch.randn(m.weight.shape, generator=g) * 1e-3).to(dev) for n, m in mods.items()}
    out = {}
    for precision in a.precisions.split(","):
        with make_scorer(model, mods, V,
                         execution=ExecutionContext.of(model, precision=precision, cuda_graphs="off")) as sc:
            for b in batches[:2]:
                sc.score(b)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for b in batches[2:]:
                    sc.score(b)
                torch.cuda.synchronize()
        rows = prof.key_averages()
        total = sum(e.self_device_time_total for e in rows)
        print(f"\n## {a.config}, {precision}: {total / 1e3 / (len(batches) - 2):.2f} ms CUDA time per batch of {a.batch}")
        print("| operator | ms / batch | share | calls / batch |")
        print("|---|---|---|---|")
        table = []
        for e in sorted(rows, key=lambda e: e.self_device_time_total, reverse=True)[:a.top]:
            ms = e.self_device_time_total / 1e3 / (len(batches) - 2)
            table.append({"op": e.key, "ms_per_batch": ms, "calls_per_batch": e.count / (len(batches) - 2)})
            print(f"| {e.key[:70]} | {ms:.3f} | {e.self_device_time_total / total:.1%} | "
                  f"{e.count / (len(batches) - 2):.0f} |")
        out[precision] = {"ms_per_batch": total / 1e3 / (len(batches) - 2), "top": table}
    if a.json:
        Path(a.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                            "argv": sys.argv, "profiles": out}, indent=1))


if __name__ == "__main__":
    main()
