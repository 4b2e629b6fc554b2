"""One-process benchmark of every route, side by side on the same model, batch and length.

Measures, in this order: plain forward (inference), forward+backward (a training step,
HF loss), exact scoring (the fused route and the hook-based route, ``impl="hooks"``), the EK-FAC fit
(factors pass, eigendecompositions, eigenvalue pass) and, if importable, kronfluence's
EK-FAC. Prints a table (ex/s, real tokens/s, ratios, peak GPU memory) and writes JSON.

Models: ``--config 0.3b`` (Llama, hidden 1024, 16 layers, 271M params), ``1b``
(TinyLlama shape, 1.1B), ``llama8b`` (Llama-3.1-8B's shape; use ``--fit-n 0``), ``tiny``
(CPU smoke test), random init, random tokens of
``--seq-len``; or ``--config embedded`` (SmolLM2-135M-Instruct, GGUF) on real text
(``--pool`` GSM8K jsonl), where PRISM's own direction (``--targets``) and EK-FAC give
``v`` and the other routes are compared to the exact one (Pearson, Spearman, top-5%).

    python benchmarks/bench_scoring.py --config 0.3b --seq-len 512 --batch 16 --n 512 --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prism_select import engine  # noqa: E402
from prism_select.curvature import CurvatureSettings, fit_curvature  # noqa: E402
from prism_select.runtime.execution import ExecutionContext  # noqa: E402
from prism_select.data.tokenize import Encoded, collate, encode  # noqa: E402
from prism_select.runtime.execution import Kernels  # noqa: E402
from prism_select.runtime.graphs import GraphedScorer  # noqa: E402
from prism_select.metrics import spearman  # noqa: E402
from prism_select.scoring import make_scorer  # noqa: E402

CONFIGS = {
    "tiny": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, vocab_size=1000),
    "0.3b": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16,
                 num_key_value_heads=16, vocab_size=32000),
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
               num_key_value_heads=4, vocab_size=32000),
    # Llama-3.1-8B's shape (benchmarks/scale_setup.py): with --fit-n 0, the training step and
    # the exact scoring side by side at paper scale (the fit at 8B needs the memory plan)
    "llama8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
}


def log(*a):
    print(*a, flush=True)


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def build_random(name, dtype, dev, seq_len):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(**CONFIGS[name], max_position_embeddings=max(2048, seq_len), tie_word_embeddings=False,
                      attn_implementation="sdpa")
    with torch.device(dev):
        torch.set_default_dtype(dtype)  # built in the dtype: an 8B model in float32 would take 32 GB first
        try:
            model = LlamaForCausalLM(cfg)
        finally:
            torch.set_default_dtype(torch.float32)
    model.eval()
    return model, None


def random_data(n, seq_len, vocab, response_from):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (n, seq_len), generator=g)
    start = max(1, int(seq_len * response_from))
    return [Encoded(ids[i].tolist(), start) for i in range(n)]


def batches_of(encoded, bs):
    order = sorted(range(len(encoded)), key=lambda i: (len(encoded[i].input_ids), i))
    return [order[k:k + bs] for k in range(0, len(order), bs)]


WARM_ALL = False


def run_phase(name, fn, encoded, batches, pad_id, dev, warm=2, results=None):
    """Time ``fn(batch_dict) -> scores or None`` over all batches (after ``warm`` untimed)."""
    out = {}
    try:
        cols = [engine.collate_to([encoded[i] for i in b], pad_id, dev) for b in batches]
        for b in (cols if WARM_ALL else cols[:warm]):
            fn(b)
        sync(dev)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        t = time.perf_counter()
        scores = []
        for b in cols:
            s = fn(b)
            if s is not None:
                scores.append(s.detach())
        sync(dev)
        dt = time.perf_counter() - t
        n = sum(len(b) for b in batches)
        real = sum(len(encoded[i].input_ids) for b in batches for i in b)
        out = {"seconds": dt, "ex_per_s": n / dt, "real_tok_per_s": real / dt,
               "peak_gib": torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None}
        if scores:
            order = [i for b in batches for i in b]
            full = torch.full((len(encoded),), float("nan"), dtype=torch.float64)  # unscored: NaN
            full[order] = torch.cat(scores).double().cpu()
            out["_scores"] = full
        log(f"  {name:<22} {out['ex_per_s']:9.1f} ex/s  {out['real_tok_per_s']:11.0f} tok/s  "
            f"peak {out['peak_gib'] or 0:6.2f} GiB")
    except Exception as e:  # keep going: one failing route must not lose the others
        import traceback
        traceback.print_exc()
        out = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        log(f"  {name:<22} FAILED {out['error']}")
    if results is not None:
        results[name] = out
    return out


def pearson(a, b):
    return float(torch.corrcoef(torch.stack([a.double(), b.double()]))[0, 1])


def top_overlap(a, b, frac=0.05):
    k = max(1, int(round(len(a) * frac)))
    ta = set(torch.topk(a, k).indices.tolist())
    tb = set(torch.topk(b, k).indices.tolist())
    return len(ta & tb) / k


def accuracy(ref, s):
    """Agreement over the examples both routes scored (a route may score a subset)."""
    both = torch.isfinite(ref) & torch.isfinite(s)
    ref, s = ref[both], s[both]
    return {"n": int(both.sum()), "pearson": pearson(ref, s), "spearman": spearman(ref, s),
            "top5_overlap": top_overlap(ref, s), "rel_err": float((s - ref).norm() / ref.norm())}


def load_embedded(dev, dtype):
    from prism_select.model import ModelSettings, load_model
    dt = {torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype]
    lm = load_model(ModelSettings(model=os.environ.get("PRISM_SELECT_DEFAULT_GGUF", "default"), dtype=dt,
                                  device=str(dev)))
    return lm.model, lm.tokenizer


def read_gsm8k(path, n, tok, max_length, offset=0):
    recs = []
    with open(path) as f:
        for i, line in enumerate(f):
            if i < offset:
                continue
            if len(recs) >= n:
                break
            recs.append(json.loads(line))
    return recs


def gsm8k_targets(recs, tok, max_length):
    """(q, correct solution, same solution with a wrong final answer)."""
    chosen, rejected = [], []
    for r in recs:
        ans = r["answer"]
        head, _, final = ans.rpartition("####")
        try:
            wrong = str(int(final.strip().replace(",", "")) + 7)
        except ValueError:
            wrong = final.strip() + "1"
        chosen.append(encode(tok, r["question"], ans, max_length))
        rejected.append(encode(tok, r["question"], head + "#### " + wrong, max_length))
    return chosen, rejected


def kronfluence_fit(model, modules, encoded, pad_id, dev, batch):
    """kronfluence 1.0.1 EK-FAC factors (bf16 amp) on ``encoded``; returns seconds."""
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments
    from kronfluence.task import Task

    names = list(modules)

    class _Task(Task):
        def compute_train_loss(self, batch, model, sample=False):
            b = batch
            out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
            logits = out.logits[:, :-1].float()
            labels = b["labels"][:, 1:]
            return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1),
                                                     ignore_index=-100, reduction="sum")

        def compute_measurement(self, batch, model):
            b = batch
            return self.compute_train_loss(b, model)

        def get_influence_tracked_modules(self):
            return names

        def get_attention_mask(self, batch):
            b = batch
            return b["attention_mask"]

    class _DS(torch.utils.data.Dataset):
        def __len__(self):
            return len(encoded)

        def __getitem__(self, i):
            return encoded[i]

    def coll(items):
        return collate(items, pad_id)

    for p in model.parameters():
        p.requires_grad_(True)
    task = _Task()
    model = prepare_model(model, task)
    import tempfile
    d = tempfile.mkdtemp()
    an = Analyzer(analysis_name="bench", model=model, task=task, output_dir=d, disable_tqdm=True)
    from kronfluence.utils.dataset import DataLoaderKwargs
    an.set_dataloader_kwargs(DataLoaderKwargs(collate_fn=coll))
    fa = FactorArguments(strategy="ekfac", amp_dtype=torch.bfloat16)
    t = time.perf_counter()
    an.fit_all_factors(factors_name="f", dataset=_DS(), per_device_batch_size=batch, factor_args=fa,
                       overwrite_output_dir=True)
    sync(dev)
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="0.3b", choices=list(CONFIGS) + ["embedded"])
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--n", type=int, default=512, help="examples timed per route")
    ap.add_argument("--response-from", type=float, default=0.0,
                    help="random data: fraction of each sequence that is prompt (no loss); 0 = all response")
    ap.add_argument("--fit-n", type=int, default=512, help="examples for the EK-FAC fit timing (0 = skip)")
    ap.add_argument("--routes", default="forward,fwd_bwd,exact,exact_bmm,exact_mulsum,exact_fusedce,"
                                        "exact_hooks,fit,kronfluence")
    ap.add_argument("--kron-n", type=int, default=None, help="examples for kronfluence's fit (default --fit-n)")
    ap.add_argument("--pool", default=None, help="embedded: GSM8K-style jsonl (question/answer)")
    ap.add_argument("--targets", type=int, default=64, help="embedded: target pairs built from the pool file")
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--warm-all", action="store_true",
                    help="warm up on every batch before timing (variable lengths: per-shape kernel setup)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    global WARM_ALL
    WARM_ALL = a.warm_all

    dev = torch.device("cuda" if (a.device == "auto" and torch.cuda.is_available()) else
                       ("cpu" if a.device == "auto" else a.device))
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[a.dtype]
    routes = [r.strip() for r in a.routes.split(",") if r.strip()]
    info = {"config": a.config, "seq_len": a.seq_len, "batch": a.batch, "n": a.n, "dtype": a.dtype,
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "argv": sys.argv}
    import transformers
    info["transformers"] = transformers.__version__
    log(f"# {info['device']}  torch {torch.__version__}  transformers {transformers.__version__}")

    if a.config == "embedded":
        model, tok = load_embedded(dev, dtype)
        pad_id = tok.pad_token_id
        recs = read_gsm8k(a.pool, a.n, tok, a.max_length)
        encoded = [encode(tok, r["question"], r["answer"], a.max_length) for r in recs]
        trecs = read_gsm8k(a.pool, a.targets, tok, a.max_length, offset=a.n)
        chosen, rejected = gsm8k_targets(trecs, tok, a.max_length)
    else:
        model, _ = build_random(a.config, dtype, dev, a.seq_len)
        pad_id = 0
        encoded = random_data(a.n, a.seq_len, model.config.vocab_size, a.response_from)
    from prism_select.model import tracked_linear_modules
    modules = tracked_linear_modules(model)
    n_params = sum(p.numel() for p in model.parameters())
    info["params"] = n_params
    info["tracked_params"] = sum(m.weight.numel() for m in modules.values())
    log(f"# {a.config}: {n_params / 1e6:.1f}M params, {len(modules)} tracked layers, {len(encoded)} examples, "
        f"mean length {sum(len(e.input_ids) for e in encoded) / len(encoded):.0f}, batch {a.batch}")
    batches = batches_of(encoded, a.batch)
    R: dict = {}
    weights_gib = torch.cuda.memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
    info["weights_gib"] = weights_gib

    # -- the direction v
    t = time.perf_counter()
    cur = None
    if a.config == "embedded":
        from prism_select.preference import DIRECTION_KERNELS, compute_preference
        pref = compute_preference(model, modules, chosen, rejected, pad_id=pad_id, batch_size=a.batch,
                                  execution=ExecutionContext.of(model, progress=False, kernels=DIRECTION_KERNELS))
        info["pi_mean"] = float(pref.pi.mean())
        direction = pref.direction
    else:
        # drawn on the device in the model's dtype: at 8B a float32 direction alone is 28 GB
        g = torch.Generator(device=dev).manual_seed(2)
        direction = {n: torch.randn(m.weight.shape, generator=g, device=dev, dtype=dtype) * 1e-3
                     for n, m in modules.items()}
    info["direction_s"] = time.perf_counter() - t

    # -- references
    def fwd(b):
        with torch.no_grad():
            model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False)

    def fwd_bwd(b):
        out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"], use_cache=False)
        out.loss.backward()
        for p in model.parameters():
            p.grad = None

    class _Ref:  # a reference step as a "scorer", so GraphedScorer can capture it too
        def __init__(self, train):
            self.train = train

        def score(self, b):
            B = b["input_ids"].shape[0]
            if not self.train:
                with torch.no_grad():
                    model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False)
                return torch.zeros(B, device=b["input_ids"].device)
            out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"],
                        use_cache=False)
            out.loss.backward()  # gradients accumulate in place across replays (timing only)
            return torch.zeros(B, device=b["input_ids"].device)

    def ref_route(name, train, graphs=False, nomask=False):
        if name not in routes:
            return
        flags = [(p, p.requires_grad) for p in model.parameters()]
        for p, _ in flags:
            p.requires_grad_(train)
        try:
            if graphs:
                sc = GraphedScorer(_Ref(train), a.batch, pad_id)
                fn = sc.score
            elif nomask:
                fn = lambda b: _Ref(train).score(engine.causal_only(b))  # noqa: E731
            else:
                fn = fwd_bwd if train else fwd
            r = run_phase(name, fn, encoded, batches, pad_id, dev, results=R)
            r.pop("_scores", None)
            if graphs:
                r["graph_captures"] = sc.captures
                r["graph_failed"] = sc.failed
                sc.graphs.clear()
        finally:
            for p, f in flags:
                p.requires_grad_(f)
                p.grad = None
            if dev.type == "cuda":
                torch.cuda.empty_cache()

    log("## throughput")
    ref_route("forward", False)
    ref_route("fwd_bwd", True)
    # transparency: the same references without the attention mask, and CUDA-graphed
    ref_route("forward_nomask", False, nomask=True)
    ref_route("fwd_bwd_nomask", True, nomask=True)
    ref_route("forward_graphs", False, graphs=True)
    ref_route("fwd_bwd_graphs", True, graphs=True)

    # -- curvature (also gives v for the embedded model); "fit" with the library default
    # (CUDA graphs on a GPU), "fit_eager" without graphs
    # (fit_s32: the fit as --precision split32 runs it; fit_f32w: on the weights upcast to
    # float32, a comparison route: float32 GEMMs without tensor cores)
    from prism_select.engine.policy import direction_policy
    from prism_select.runtime.precision import float32_weights
    for fit_name, graphs, precision in (("fit", "auto", "model"), ("fit_eager", "off", "model"),
                                        ("fit_s32", "auto", "split32"), ("fit_f32w", "auto", "f32w")):
        if fit_name not in routes or a.fit_n <= 0:
            continue
        fit_enc = (encoded * math.ceil(a.fit_n / len(encoded)))[:a.fit_n]
        try:
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            tm: dict = {"cuda_graphs": graphs, "precision": precision}
            sync(dev)
            t = time.perf_counter()
            with float32_weights(model, precision == "f32w"):
                c = fit_curvature(model, modules, fit_enc, CurvatureSettings(kind="ekfac", batch_size=a.batch),
                                  pad_id=pad_id, timings=tm, execution=ExecutionContext.of(
                                      model, dev, progress=False, cuda_graphs=graphs,
                                      precision="model" if precision == "f32w" else precision))
            sync(dev)
            tm["total_s"] = time.perf_counter() - t
            tm["examples"] = len(fit_enc)
            tm["peak_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
            tm["factors_gib"] = sum(t.numel() * t.element_size() for t in c.tensors.values()) / 2**30
            if "fwd_bwd" in R and "ex_per_s" in R["fwd_bwd"]:
                epoch = len(fit_enc) / R["fwd_bwd"]["ex_per_s"]
                tm["epoch_s"] = epoch
                tm["passes_over_epoch"] = (tm["factors_s"] + tm["lambda_s"]) / epoch
            R[fit_name] = tm
            cur = c if cur is None else cur
            log(f"  {fit_name} ekfac on {len(fit_enc)}: factors {tm['factors_s']:.2f}s  eigh {tm['eigh_s']:.2f}s  "
                f"lambda {tm['lambda_s']:.2f}s  (passes = {tm.get('passes_over_epoch', float('nan')):.2f}x a "
                f"fwd+bwd epoch)  peak {tm['peak_gib'] or 0:.2f} GiB  factors {tm['factors_gib']:.2f} GiB")
            del c
        except Exception as e:
            import traceback
            traceback.print_exc()
            R[fit_name] = {"error": f"{type(e).__name__}: {e}"}
    # -- the target direction's cost, warm, as --precision model and split32 compute it
    # (random configs: the first --targets examples against the next ones)
    # (direction_f32w: on the weights upcast to float32, a comparison route)
    for d_name, precision in (("direction", "model"), ("direction_s32", "split32"), ("direction_f32w", "f32w")):
        if d_name not in routes:
            continue
        from prism_select.preference import DIRECTION_KERNELS, compute_preference
        ch, rj = (chosen, rejected) if a.config == "embedded" else \
            (encoded[:a.targets], encoded[a.targets:2 * a.targets])
        times = []
        for _ in range(2):  # the first call warms up; the second is reported
            sync(dev)
            t = time.perf_counter()
            with float32_weights(model, precision == "f32w"), \
                    direction_policy(model, ExecutionContext.of(
                        model, precision="model" if precision == "f32w" else precision)):
                compute_preference(model, modules, ch, rj, pad_id=pad_id, batch_size=a.batch,
                                   execution=ExecutionContext.of(model, progress=False, kernels=DIRECTION_KERNELS))
            sync(dev)
            times.append(time.perf_counter() - t)
        R[d_name] = {"seconds": times[-1], "cold_seconds": times[0], "pairs": len(ch), "precision": precision}
        log(f"  {d_name}: {len(ch)} pairs in {times[-1]:.3f}s warm ({times[0]:.3f}s cold)")
    if cur is not None and a.config == "embedded":
        V = cur.precondition(direction)
    else:
        V = direction
    V = {n: t.to(dev) for n, t in V.items()}
    del cur, direction
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        info["resident_gib_scoring"] = torch.cuda.memory_allocated(dev) / 2**30
        log(f"  resident before scoring (weights + v): {info['resident_gib_scoring']:.2f} GiB")

    def scorer_fn(**kw):
        sc = make_scorer(model, modules, V, pad_id=pad_id, execution=ExecutionContext.of(model, dev, cuda_graphs="off"),
                         **kw)
        state = {"entered": False}

        def f(b):
            if not state["entered"]:
                sc.__enter__()
                state["entered"] = True
            return sc.score(b)
        return f, sc

    def exact_variant(name, backend="auto", fused_loss=True, impl="auto"):
        if name not in routes:
            return
        if impl == "hooks":
            f, sc = scorer_fn(impl="hooks")
        else:
            sc = engine.ExactScorer(model, modules, V, fused_loss=fused_loss, kernels=Kernels(rowdot=backend))
            sc.__enter__()
            f = sc.score
        try:
            run_phase(name, f, encoded, batches, pad_id, dev, results=R)
        finally:
            try:
                sc.__exit__(None, None, None)
            except Exception:
                pass

    exact_variant("exact", "auto")
    if "exact_fp32" in routes:  # the true exact: the same scores on a float32 copy of the model
        import copy
        m32 = copy.deepcopy(model).float()
        mods32 = tracked_linear_modules(m32)
        sc = engine.ExactScorer(m32, mods32, {n: t.float() for n, t in V.items()})
        with sc:
            run_phase("exact_fp32", sc.score, encoded, batches, pad_id, dev, results=R)
        del sc, m32, mods32
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    exact_variant("exact_bmm", "bmm")
    exact_variant("exact_mulsum", "mulsum")
    exact_variant("exact_fusedce", "auto", fused_loss=True)
    exact_variant("exact_hooks", impl="hooks")
    def lib_route(name, graphs, precision="model", split_gemm="two", split_backward=False):
        """The library's own scorer, as the CLI builds it (``make_scorer``)."""
        if name not in routes:
            return
        sc = make_scorer(model, modules, V, pad_id=pad_id, batch_size=a.batch, execution=ExecutionContext.of(
            model, dev, cuda_graphs="on" if graphs else "off", precision=precision,
            kernels=Kernels(split_gemm=split_gemm, split_backward=split_backward)))
        try:
            with sc:
                r = run_phase(name, sc.score, encoded, batches, pad_id, dev, results=R)
                if graphs:
                    r["graph_captures"] = sc.captures
                    r["graph_failed"] = sc.failed
        finally:
            del sc
            if dev.type == "cuda":
                torch.cuda.empty_cache()

    lib_route("lib_exact", False)
    lib_route("lib_exact_graphs", True)
    # --precision residual32: the residual stream in float32, matmuls in the model dtype
    lib_route("lib_exact_r32", False, precision="residual32")
    lib_route("lib_exact_r32_graphs", True, precision="residual32")
    # --precision split32: float32 activations, linear layers as split half-precision GEMMs
    lib_route("lib_exact_s32", False, precision="split32")
    lib_route("lib_exact_s32_graphs", True, precision="split32")
    lib_route("lib_exact_s32k_graphs", True, precision="split32", split_gemm="kcat")
    lib_route("lib_exact_s32b_graphs", True, precision="split32", split_backward=True)
    if "kronfluence" in routes and a.fit_n > 0:
        try:
            import kronfluence  # noqa: F401
            kn = a.kron_n or a.fit_n
            fit_enc = (encoded * math.ceil(kn / len(encoded)))[:kn]
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            secs = kronfluence_fit(model, modules, fit_enc, pad_id, dev, a.batch)
            R["kronfluence_fit"] = {"seconds": secs, "examples": len(fit_enc),
                                    "peak_gib": torch.cuda.max_memory_allocated(dev) / 2**30
                                    if dev.type == "cuda" else None}
            log(f"  kronfluence ekfac fit on {len(fit_enc)}: {secs:.2f}s")
        except ImportError:
            R["kronfluence_fit"] = {"skipped": "kronfluence is not importable (pip install kronfluence)"}
            log("  kronfluence: skipped (not importable)")
        except Exception as e:
            import traceback
            traceback.print_exc()
            R["kronfluence_fit"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}

    # -- accuracy against the exact route
    ref_name = "exact" if "_scores" in R.get("exact", {}) else None
    acc = {}
    if ref_name:
        ref = R[ref_name]["_scores"]
        for k, v in R.items():
            if isinstance(v, dict) and "_scores" in v and k != ref_name and "randv" not in k:
                acc[k] = accuracy(ref, v["_scores"][: len(ref)] if len(v["_scores"]) == len(ref) else v["_scores"])
    acc32 = {}  # against the float32 exact route, where it ran
    if "_scores" in R.get("exact_fp32", {}):
        ref32 = R["exact_fp32"]["_scores"]
        for k, v in R.items():
            if isinstance(v, dict) and "_scores" in v and k != "exact_fp32" and "randv" not in k:
                acc32[k] = accuracy(ref32, v["_scores"])
    if "_scores" in R.get("exact_hooks", {}) and ref_name:
        acc["exact(vs hooks fp32)"] = accuracy(R["exact_hooks"]["_scores"], R[ref_name]["_scores"])

    # -- table
    fwd_r = R.get("forward", {}).get("ex_per_s")
    fb_r = R.get("fwd_bwd", {}).get("ex_per_s")
    log("")
    log(f"## {a.config} on {info['device']}, {a.dtype}, batch {a.batch}, {len(encoded)} examples")
    log("| route | ex/s | real tok/s | / fwd+bwd | / forward | peak GiB | Spearman vs exact | top-5% overlap "
        "| Spearman vs exact fp32 | top-5% vs fp32 |")
    log("|---|---|---|---|---|---|---|---|---|---|")
    nan = float("nan")
    for k, v in R.items():
        if not isinstance(v, dict) or "ex_per_s" not in v:
            continue
        ac, ac32 = acc.get(k, {}), acc32.get(k, {})
        log(f"| {k} | {v['ex_per_s']:.1f} | {v['real_tok_per_s']:.0f} | "
            f"{v['ex_per_s'] / fb_r if fb_r else nan:.2f} | {v['ex_per_s'] / fwd_r if fwd_r else nan:.2f} | "
            f"{v['peak_gib'] or 0:.2f} | {ac.get('spearman', nan):.4f} | {ac.get('top5_overlap', nan):.3f} | "
            f"{ac32.get('spearman', nan):.4f} | {ac32.get('top5_overlap', nan):.3f} |")
    for k, v in R.items():
        if isinstance(v, dict) and ("error" in v or "skipped" in v):
            log(f"| {k} | {v.get('error') or v.get('skipped')} |")
    for fit_name in ("fit", "fit_eager", "fit_s32", "fit_f32w"):
        if fit_name not in R or "factors_s" not in R[fit_name]:
            continue
        f = R[fit_name]
        log(f"{fit_name} EK-FAC ({f['examples']} ex, cuda_graphs {f['cuda_graphs']}, {f['precision']}): "
            f"factors {f['factors_s']:.2f}s + lambda {f['lambda_s']:.2f}s = "
            f"{f.get('passes_over_epoch', float('nan')):.2f}x one fwd+bwd epoch; eigh {f['eigh_s']:.2f}s (fixed); "
            f"peak {f['peak_gib'] or 0:.2f} GiB, factors {f['factors_gib']:.2f} GiB")
    if "kronfluence_fit" in R and "seconds" in R["kronfluence_fit"] and fb_r:
        kf = R["kronfluence_fit"]
        kf["epochs"] = kf["seconds"] / (kf["examples"] / fb_r)
        log(f"kronfluence EK-FAC fit ({kf['examples']} ex, incl. its eigendecompositions): {kf['seconds']:.2f}s = "
            f"{kf['epochs']:.2f}x one fwd+bwd epoch")
    for k, v in R.items():
        if isinstance(v, dict) and "_scores" in v:
            x = v["_scores"][torch.isfinite(v["_scores"])]
            v["score_stats"] = {"mean": float(x.mean()), "std": float(x.std()), "min": float(x.min()),
                                "max": float(x.max())}
            log(f"scores {k}: mean {x.mean():.4g} std {x.std():.4g} min {x.min():.4g} max {x.max():.4g}")
    for k, v in acc.items():
        log(f"accuracy {k}: pearson {v['pearson']:.5f} spearman {v['spearman']:.5f} "
            f"top5 {v['top5_overlap']:.3f} rel_err {v['rel_err']:.2e}")
    if a.json:
        clean = {k: ({kk: vv for kk, vv in v.items() if kk != "_scores"} if isinstance(v, dict) else v)
                 for k, v in R.items()}
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"info": info, "results": clean, "accuracy": acc,
                                            "accuracy_vs_fp32": acc32}, indent=1))


if __name__ == "__main__":
    main()
