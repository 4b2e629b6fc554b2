"""Accuracy (and rough cost) of the mixed-precision JVP route (benchmarks/mixed_jvp.py) on
the embedded model (SmolLM2-135M-Instruct) with PRISM's own preconditioned direction.

Reproduces ``bench_scoring.py --config embedded``'s setup on a smaller scale: a pool of
``--n`` GSM8K records, ``--targets`` target pairs from the records after the pool
(``gsm8k_targets``: correct vs. +7 final answer), ``compute_preference`` -> direction,
EK-FAC fitted on the pool, ``precondition`` -> V (cached with torch.save). Then scores
the pool with:

    exact fp32   ExactScorer on a float32 copy of the bf16 weights (the reference)
    exact bf16   ExactScorer on the bf16 model
    jvp fp32     MixedJVPScorer on the float32 copy (an exact forward-mode derivative)
    jvp[...]     MixedJVPScorer on the bf16 model with the named tangent sites in float32
                 (``none`` = a plain bf16 JVP; ``all`` = every site; ``all-X`` = all but X;
                 ``only-X``; ``all+fp32mm`` = every site and float32 tangent GEMM operands)
    jvp fp32 [emu=K1+K2]  MixedJVPScorer on the float32 copy with only the GEMM operands
                 of kinds K (linear, attn, head) and/or the stored residual stream
                 (residual) rounded to bf16: which roundings of the *primal* matter

and prints Spearman, Pearson, relative error and top-5% / top-10% overlap against
exact fp32 (and Spearman against exact bf16), then (``--timing``) times one batch.
Scores of each route are cached in ``--cache`` so an interrupted run resumes.

    python benchmarks/jvp_accuracy.py --pool /work/shared/data/gsm8k/train.jsonl --n 128 \
        --targets 32 --max-length 384 --json benchmarks/results/jvp_accuracy_cpu.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from prism_select import engine  # noqa: E402
from prism_select.data.tokenize import encode  # noqa: E402
from prism_select.evaluation_metrics import spearman  # noqa: E402
from bench_scoring import gsm8k_targets, read_gsm8k  # noqa: E402  (the same pool and pairs as bench_scoring)
from mixed_jvp import SITES, MixedJVPScorer, matmul_flops_per_token  # noqa: E402


def log(*a):
    print(*a, flush=True)


def top_overlap(ref, s, frac):
    k = max(1, int(round(len(ref) * frac)))
    a = set(torch.topk(ref, k).indices.tolist())
    b = set(torch.topk(s, k).indices.tolist())
    return len(a & b) / k


def metrics(ref, s):
    return {"spearman": spearman(ref.tolist(), s.tolist()),
            "pearson": float(torch.corrcoef(torch.stack([ref, s]))[0, 1]),
            "rel_err": float((s - ref).norm() / ref.norm()),
            "top5": top_overlap(ref, s, 0.05), "top10": top_overlap(ref, s, 0.10)}


def variants(spec: str):
    """``name -> dict(sites=..., fp32_matmuls=...)`` from a comma list."""
    out = {}
    for v in [x.strip() for x in spec.split(",") if x.strip()]:
        if v == "none":
            out[v] = dict(sites=())
        elif v == "all":
            out[v] = dict(sites=SITES)
        elif v == "all+fp32mm":
            out[v] = dict(sites=SITES, fp32_matmuls=True)
        elif v.startswith("all-"):
            out[v] = dict(sites=tuple(s for s in SITES if s != v[4:]))
        elif v.startswith("only-"):
            out[v] = dict(sites=(v[5:],))
        elif v.startswith("sites="):
            out[v] = dict(sites=tuple(x for x in v[6:].split("+") if x))
        elif v.startswith("emu="):  # float32 model, bf16-rounded GEMM operands of these kinds
            out[v] = dict(emulate_operands=torch.bfloat16, emulate_kinds=tuple(x for x in v[4:].split("+") if x))
        else:
            raise SystemExit(f"unknown variant {v!r}")
    return out


class _PartsScorer(engine.ExactScorer):
    """ExactScorer that also returns the per-layer terms ``s_l`` of each example."""

    def score_parts(self, batch):
        self.state.parts = []
        with torch.enable_grad():
            losses, _ = engine.batch_losses(self.model, engine.causal_only(batch), split=self.split)
            losses.sum().backward()
        parts, self.state.parts = self.state.parts, []
        return torch.stack([p.double() for p in parts])  # (layers, B)


def cancellation(model32, modules32, V, cols):
    """How much the score is a small remainder of larger terms: per-layer terms
    (``sum_l |s_l| / |sum_l s_l|``), per-token terms of the loss JVP, and the size of the
    ``V x`` tangent source against the primal ``W x``."""
    lr, tr, kr = [], [], []
    with _PartsScorer(model32, modules32, V) as sc:
        for col in cols:
            P = sc.score_parts(col)
            lr += (P.abs().sum(0) / P.sum(0).abs()).tolist()

    class _Kappa(engine.Tap):
        keep_input = True

        def __init__(self, module, Vw, acc):
            super().__init__(module)
            self.Vw, self.acc = Vw, acc

        def on_backward(self, x, g):  # sum_t |b_t| |V a_t| per example
            u = x @ self.Vw.T
            self.acc += (g.double().norm(dim=-1) * u.double().norm(dim=-1)).sum(1)

    for col in cols:
        B = col["input_ids"].shape[0]
        acc = torch.zeros(B, dtype=torch.float64)
        taps = {n: _Kappa(m, V[n][:, :m.in_features].float(), acc) for n, m in modules32.items()}
        with engine.tap_linears(model32, taps), torch.enable_grad():
            losses, _ = engine.batch_losses(model32, engine.causal_only(col))
            losses.sum().backward()
        with _PartsScorer(model32, modules32, V) as sc:
            s = sc.score_parts(col).sum(0)
        kr += (acc / s.abs()).tolist()
    jv = MixedJVPScorer(model32, modules32, V)
    for col in cols:
        jv.token_terms = []
        s = jv.score(col).double()
        absum = torch.zeros_like(s)
        for bi, t in jv.token_terms:
            absum.index_add_(0, bi, t.abs().double())
        tr += (absum / s.abs()).tolist()
    ratios = []
    col = cols[0]
    acts = {}
    hooks = [m.register_forward_hook(lambda m, i, o, n=n: acts.__setitem__(n, i[0].detach()))
             for n, m in modules32.items()]
    with torch.no_grad():
        model32(input_ids=col["input_ids"], use_cache=False)
    for h in hooks:
        h.remove()
    for n, m in modules32.items():
        x = acts[n]
        Vw = V[n][:, :m.in_features].float()
        ratios.append(float((x @ Vw.T).norm() / (x @ m.weight.detach().T).norm()))

    def med(x):
        return float(torch.tensor(x).median())
    return {"examples": len(lr), "layer_ratio_median": med(lr), "layer_ratio_max": max(lr),
            "token_layer_ratio_median": med(kr), "token_layer_ratio_max": max(kr),
            "token_ratio_median": med(tr), "token_ratio_max": max(tr), "vx_over_wx_median": med(ratios),
            "vx_over_wx_max": max(ratios)}


DEFAULT_VARIANTS = ",".join(["none", "all"] + [f"all-{s}" for s in SITES] + [f"only-{s}" for s in SITES]
                            + ["all+fp32mm"])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pool", required=True, help="GSM8K train jsonl (question/answer)")
    ap.add_argument("--n", type=int, default=128, help="pool examples scored (and the EK-FAC fit set)")
    ap.add_argument("--targets", type=int, default=32, help="target pairs, from the records after the pool")
    ap.add_argument("--score-n", type=int, default=None,
                    help="score this many pool records: the --n fit records plus those after the target "
                         "records (default: the --n fit records only)")
    ap.add_argument("--max-length", type=int, default=384)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    ap.add_argument("--timing", action="store_true", help="time one batch: forward, JVP, exact (bf16 model)")
    ap.add_argument("--timing-only", action="store_true", help="skip the accuracy part")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cancellation", type=int, default=2,
                    help="batches for the cancellation diagnostic (per-layer and per-token terms; 0 = skip)")
    ap.add_argument("--cache", default="/tmp/jvp_accuracy_cache")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cache = Path(a.cache)
    cache.mkdir(parents=True, exist_ok=True)
    tag = f"n{a.n}_t{a.targets}_L{a.max_length}"
    stag = tag if not a.score_n or a.score_n <= a.n else f"{tag}_s{a.score_n}"

    from prism_select.model import ModelSettings, load_model, tracked_linear_modules
    lm = load_model(ModelSettings(model=os.environ.get("PRISM_SELECT_DEFAULT_GGUF", "default"), dtype="bfloat16",
                                  device="cpu"))
    model, tok = lm.model, lm.tokenizer
    model.eval()
    pad_id = tok.pad_token_id
    modules = tracked_linear_modules(model)
    model32 = copy.deepcopy(model).float()  # the same (bf16-rounded) weights, float32 arithmetic
    model32.eval()
    names32 = dict(model32.named_modules())
    modules32 = {n: names32[n] for n in modules}

    recs = read_gsm8k(a.pool, a.n, tok, a.max_length)
    fit_encoded = [encode(tok, r["question"], r["answer"], a.max_length) for r in recs]
    encoded = list(fit_encoded)
    if a.score_n and a.score_n > a.n:  # more pool records scored: those after the target records
        recs2 = read_gsm8k(a.pool, a.score_n - a.n, tok, a.max_length, offset=a.n + a.targets)
        encoded += [encode(tok, r["question"], r["answer"], a.max_length) for r in recs2]
    lengths = [len(e.input_ids) for e in encoded]
    resp = sum(len(e.input_ids) - e.response_start for e in encoded) / sum(lengths)
    log(f"# EK-FAC fit on {len(fit_encoded)} records; scored pool {len(encoded)} GSM8K records, "
        f"mean length {sum(lengths) / len(lengths):.0f}, max {max(lengths)}, response fraction {resp:.2f}")
    order = sorted(range(len(encoded)), key=lambda i: (lengths[i], i))
    batches = [order[k:k + a.batch] for k in range(0, len(order), a.batch)]
    cols = [engine.collate_to([encoded[i] for i in b], pad_id, None) for b in batches]

    info = {"argv": sys.argv, "torch": torch.__version__, "threads": a.threads, "n": len(encoded),
            "fit_n": len(fit_encoded), "targets": a.targets, "max_length": a.max_length,
            "mean_length": sum(lengths) / len(lengths), "response_fraction": resp}
    out = {"info": info}

    # -- FLOP estimate
    seq = sum(lengths) / len(lengths)
    fl = matmul_flops_per_token(model, modules, int(seq), resp)
    out["flops_per_token"] = fl
    log(f"# matmul GFLOP/token at mean length {seq:.0f}: forward {fl['forward'] / 1e9:.3f}, "
        f"jvp {fl['jvp'] / 1e9:.3f} ({fl['jvp'] / fl['forward']:.2f}x), "
        f"exact {fl['exact'] / 1e9:.3f} ({fl['exact'] / fl['forward']:.2f}x)")

    if not a.timing_only:
        # -- V (cached)
        vpath = cache / f"V_{tag}.pt"
        if vpath.exists():
            V = torch.load(vpath)
            log(f"# V from {vpath}")
        else:
            from prism_select.curvature import CurvatureSettings, fit_curvature
            from prism_select.runtime.execution import ExecutionContext
            from prism_select.preference import DIRECTION_KERNELS, compute_preference
            trecs = read_gsm8k(a.pool, a.targets, tok, a.max_length, offset=a.n)
            chosen, rejected = gsm8k_targets(trecs, tok, a.max_length)
            t = time.perf_counter()
            pref = compute_preference(model, modules, chosen, rejected, pad_id=pad_id, batch_size=a.batch,
                                      execution=ExecutionContext.of(model, progress=False, kernels=DIRECTION_KERNELS))
            log(f"# direction from {len(chosen)} pairs: {time.perf_counter() - t:.0f}s, pi mean {float(pref.pi.mean()):.3f}")
            t = time.perf_counter()
            cur = fit_curvature(model, modules, fit_encoded, CurvatureSettings(kind="ekfac", batch_size=a.batch),
                                pad_id=pad_id,
                                execution=ExecutionContext.of(model, "cpu", progress=False, cuda_graphs="off"))
            log(f"# EK-FAC on {len(fit_encoded)}: {time.perf_counter() - t:.0f}s")
            V = {n: t.detach().float().cpu() for n, t in cur.precondition(pref.direction).items()}
            torch.save(V, vpath)
            del cur, pref
        V = {n: t.detach() for n, t in V.items()}
        rel = max(float(V[n].norm() / modules[n].weight.detach().float().norm()) for n in modules)
        info["max_rel_V_norm"] = rel

        # -- routes
        def run(name, make, m):
            path = cache / f"scores_{stag}_{name.replace('/', '_')}.pt"
            if path.exists():
                return torch.load(path)
            sc = make()
            t = time.perf_counter()
            full = torch.empty(len(encoded), dtype=torch.float64)
            with sc as entered:
                for b, col in zip(batches, cols):
                    full[b] = entered.score(col).double()
            dt = time.perf_counter() - t
            log(f"  {name:<22} {dt:7.1f}s")
            torch.save(full, path)
            return full

        S = {}
        S["exact fp32"] = run("exact_fp32", lambda: engine.ExactScorer(model32, modules32, V), model32)
        S["exact bf16"] = run("exact_bf16", lambda: engine.ExactScorer(model, modules, V), model)
        S["jvp fp32"] = run("jvp_fp32", lambda: MixedJVPScorer(model32, modules32, V), model32)
        for vn, kw in variants(a.variants).items():
            if vn.startswith("emu="):
                S[f"jvp fp32 [{vn}]"] = run(f"jvp_fp32_{vn}", lambda kw=kw: MixedJVPScorer(model32, modules32, V, **kw),
                                            model32)
            else:
                S[f"jvp bf16 [{vn}]"] = run(f"jvp_bf16_{vn}", lambda kw=kw: MixedJVPScorer(model, modules, V, **kw),
                                            model)

        if a.cancellation:
            out["cancellation"] = cancellation(model32, modules32, V, cols[:a.cancellation])
            c = out["cancellation"]
            log(f"# cancellation (float32, {c['examples']} examples, medians): sum_l |s_l| / |s| = "
                f"{c['layer_ratio_median']:.1f}; sum_l sum_t |b_t| |V_l a_t| / |s| = {c['token_layer_ratio_median']:.0f}; "
                f"loss tokens sum_t |s_t| / |s| = {c['token_ratio_median']:.1f}; "
                f"|V_l x| / |W_l x| median over layers {c['vx_over_wx_median']:.3f}")

        ref, ref16 = S["exact fp32"], S["exact bf16"]
        acc = {}
        for k, s in S.items():
            m = metrics(ref, s)
            m["spearman_vs_exact_bf16"] = spearman(ref16.tolist(), s.tolist())
            acc[k] = m
        out["accuracy"] = acc
        out["score_stats"] = {k: {"mean": float(s.mean()), "std": float(s.std()), "min": float(s.min()),
                                  "max": float(s.max())} for k, s in S.items()}
        log("")
        log(f"## accuracy vs exact fp32 (n={len(encoded)} scored, EK-FAC on {len(fit_encoded)}, targets {a.targets}, max length {a.max_length}; "
            f"max ||V_l||/||W_l|| = {rel:.3g})")
        log("| route | Spearman | Pearson | rel. err | top-5% | top-10% | Spearman vs exact bf16 |")
        log("|---|---|---|---|---|---|---|")
        for k, m in acc.items():
            log(f"| {k} | {m['spearman']:.4f} | {m['pearson']:.4f} | {m['rel_err']:.2e} | {m['top5']:.3f} | "
                f"{m['top10']:.3f} | {m['spearman_vs_exact_bf16']:.4f} |")

    if a.timing or a.timing_only:
        # one batch of the pool's mean length (the middle batch in length order)
        col = cols[len(cols) // 2]
        B, T = col["input_ids"].shape
        g = torch.Generator().manual_seed(0)
        Vt = V if not a.timing_only else {n: torch.randn(m.out_features, m.in_features, generator=g) * 1e-3
                                          for n, m in modules.items()}

        def timeit(fn, reps=3):
            fn()
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            return (time.perf_counter() - t) / reps

        def fwd():
            with torch.no_grad():
                model(input_ids=col["input_ids"], use_cache=False)

        T_ = {"forward (HF, bf16)": timeit(fwd)}
        with engine.ExactScorer(model, modules, Vt) as ex:
            T_["exact (bf16)"] = timeit(lambda: ex.score(col))
        T_["jvp bf16 [none] (bf16 GEMM outputs)"] = timeit(lambda: MixedJVPScorer(model, modules, Vt, sites=()).score(col))
        sc = MixedJVPScorer(model, modules, Vt)
        sc.score(col)
        T_["jvp bf16 [all] (fp32 outputs emulated: fp32 GEMMs on CPU)"] = timeit(lambda: sc.score(col))
        f32 = timeit(lambda: MixedJVPScorer(model32, modules32, Vt).score(col), reps=1)
        T_["jvp fp32 model"] = f32
        out["timing"] = {"batch": B, "seq_len": T, "threads": a.threads, "seconds": T_}
        log("")
        log(f"## CPU timing, one batch {B} x {T}, {a.threads} thread(s)")
        log("| route | s | / forward |")
        log("|---|---|---|")
        for k, v in T_.items():
            log(f"| {k} | {v:.3f} | {v / T_['forward (HF, bf16)']:.2f} |")

    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
