"""A mixture-of-experts model of a real shape through ``prism-select score`` at default
flags, next to a training step of the same model, in one run: the memory plan, the fit's
phases and scoring throughput against forward+backward examples per second.

    python benchmarks/moe_scale.py --shape olmoe --layers 2 --out /tmp/moe --json moe.json

Shapes (per-layer shapes of the named model, with ``--layers`` decoder blocks, random
init, bf16 on a GPU; built from a config here, nothing downloaded): ``olmoe``
(OLMoE-1B-7B: hidden 2048, 64 experts of intermediate 1024, top 8, 16 heads, vocab
50304), ``qwen3-30b-a3b`` (Qwen3-30B-A3B: hidden 2048, 128 experts of intermediate 768,
top 8, 32 heads, 4 KV heads, head dim 128, vocab 151936; both built as Qwen3-MoE), ``tiny``
(the CPU smoke test). The pool and target pairs are the generated example
(:func:`prism_select.examples.make_example`); the tokenizer is the tests'
character-level chat tokenizer.

Steps: (1) build and save the model, write the pool and targets; (2) ``prism-select
score`` on them (a subprocess, default flags plus ``--max-length``); (3) in this process,
the training step: the model as transformers loads it (fused experts, its default
experts implementation) and as prism-select loads it (per-expert linear layers,
:mod:`prism_select.model.moe`), each ``--train-steps`` timed forward+backward steps of
``--train-batch`` examples of the pool's mean tokenised length. Prints one table and
writes JSON (plan, phases, throughputs, ratios).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

SHAPES = {
    "olmoe": dict(hidden_size=2048, moe_intermediate_size=1024, intermediate_size=1024, num_experts=64,
                  num_experts_per_tok=8, num_attention_heads=16, num_key_value_heads=16, head_dim=128,
                  vocab_size=50304, norm_topk_prob=False),
    "qwen3-30b-a3b": dict(hidden_size=2048, moe_intermediate_size=768, intermediate_size=6144, num_experts=128,
                          num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          vocab_size=151936, norm_topk_prob=True),
    "tiny": dict(hidden_size=32, moe_intermediate_size=16, intermediate_size=64, num_experts=4,
                 num_experts_per_tok=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                 vocab_size=512, norm_topk_prob=True),
}
GiB = 1 << 30


def log(*a):
    print(*a, flush=True)


def build(shape: str, layers: int, out: Path, device: str) -> int:
    from tiny import tiny_tokenizer
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    tok = tiny_tokenizer()
    cfg = Qwen3MoeConfig(**SHAPES[shape], num_hidden_layers=layers, max_position_embeddings=4096,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        model = Qwen3MoeForCausalLM(cfg).to(dtype)
        with torch.no_grad():  # the router's default init is zeros: random routing instead
            for n, p in model.named_parameters():
                if n.endswith("gate.weight"):
                    p.normal_(0.0, 0.02)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    del model
    return n


def score(model_dir: Path, pool: Path, targets: Path, run: Path, max_length: int, device: str) -> float:
    """``prism-select score`` with a cache of its own, emptied first: the fit is measured
    every time (a cached curvature of the same model would be reused)."""
    import shutil

    cache = run.parent / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    cmd = [sys.executable, "-m", "prism_select.cli", "score", "--model", str(model_dir), "--pool", str(pool),
           "--targets", str(targets), "--out", str(run), "--max-length", str(max_length), "--overwrite",
           "--cache-dir", str(cache)]
    if device == "cpu":
        cmd += ["--device", "cpu"]
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT)}
    t = time.perf_counter()
    subprocess.run(cmd, check=True, env=env)
    return time.perf_counter() - t


def train_step(model_dir: Path, eager: bool, batch: int, length: int, steps: int, device: str) -> dict:
    """Forward+backward steps (every parameter trainable, HF's loss) of random tokens."""
    from transformers import AutoModelForCausalLM

    from prism_select.model.moe import linearize_model

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, local_files_only=True).to(device)
    if eager:
        linearize_model(model)
    model.train()
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(10, model.config.vocab_size, (batch, length), generator=g).to(device)

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        for p in model.parameters():
            p.grad = None

    step()  # warm-up (kernels, allocator)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t) / steps
    out = {"step_s": dt, "ex_per_s": batch / dt, "tokens_per_s": batch * length / dt,
           "experts_implementation": None if eager else getattr(model.config, "_experts_implementation", None),
           "peak_gib": torch.cuda.max_memory_allocated() / GiB if device == "cuda" else None}
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=list(SHAPES), default="olmoe")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--pool", type=int, default=256, help="pool records")
    ap.add_argument("--targets", type=int, default=16, help="target pairs")
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--train-batch", type=int, default=8)
    ap.add_argument("--train-steps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("/tmp/moe_scale"))
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    a.out.mkdir(parents=True, exist_ok=True)
    model_dir = a.out / "model"

    from prism_select.data.tokenize import encode
    from prism_select.examples import make_example
    from tiny import tiny_tokenizer

    t = time.perf_counter()
    n_params = build(a.shape, a.layers, model_dir, device)
    pool, targets = make_example(a.out / "data", n_pool=a.pool, n_pairs=a.targets)
    log(f"built {a.shape} x {a.layers} layers ({n_params / 1e9:.2f}B parameters) and the data "
        f"in {time.perf_counter() - t:.0f} s")
    tok = tiny_tokenizer()
    rows = [json.loads(line) for line in open(pool)]
    lengths = [min(len(encode(tok, r["prompt"], r["response"]).input_ids), a.max_length) for r in rows]
    mean_len = round(sum(lengths) / len(lengths))

    run = a.out / "run"
    wall = score(model_dir, pool, targets, run, a.max_length, device)
    r = json.loads((run / "run.json").read_text())
    tm, cur = r["timings"], r.get("curvature", {})
    ph = cur.get("phases_s", {})
    scores_s = tm.get("scores_s")
    res = {
        "shape": a.shape, "layers": a.layers, "parameters": n_params, "pool": r["counts"]["pool"],
        "pairs": r["counts"]["pairs"], "mean_tokens": mean_len, "score_wall_s": wall,
        "tracking": r.get("tracking"), "memory_plan": r.get("memory_plan"),
        "gpu_peak_gib": r.get("gpu_peak_bytes", 0) / GiB, "timings": tm, "fit_phases_s": ph,
        "scoring_ex_per_s": r["counts"]["pool"] / scores_s if scores_s else None,
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        "versions": r.get("versions"), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    for k, eager in (("train_fused", False), ("train_eager", True)):
        try:
            res[k] = train_step(model_dir, eager, a.train_batch, mean_len, a.train_steps, device)
        except Exception as e:  # e.g. out of memory: the score run's figures still come back
            res[k] = {"error": f"{type(e).__name__}: {str(e)[:300]}", "ex_per_s": None, "tokens_per_s": None}
            if device == "cuda":
                torch.cuda.empty_cache()
        if res["scoring_ex_per_s"] and res[k]["ex_per_s"]:
            res[f"scoring_over_{k}"] = res["scoring_ex_per_s"] / res[k]["ex_per_s"]

    plan = res["memory_plan"] or {}
    log(f"\n{a.shape} x {a.layers} layers, {n_params / 1e9:.2f}B parameters, {res['device']}, {res['date']}")
    track = res["tracking"] or {}
    for k, e in (track.get("kinds") or {}).items():
        log(f"  tracked {k}: {e['modules']} modules, {e['parameters'] / 1e6:.1f}M parameters ({e['share']:.1%})")
    log(f"  plan peak {plan.get('peak', 0) / GiB:.1f} GiB, measured peak {res['gpu_peak_gib']:.1f} GiB, "
        f"fit groups {cur.get('groups')}, scoring batch {plan.get('scoring', {}).get('batch_size')}")
    log(f"| stage | seconds |\n|---|---|")
    for k in ("load_model_s", "preference_s", "curvature_s", "split_half_s", "scores_s", "total_s"):
        log(f"| {k} | {tm.get(k) if tm.get(k) is None else round(tm[k], 2)} |")
    for k, v in ph.items():
        log(f"| fit {k} | {round(v, 2) if isinstance(v, (int, float)) else v} |")
    log(f"\n| route | ex/s | tokens/s |\n|---|---|---|")
    if res["scoring_ex_per_s"]:
        log(f"| prism-select scoring (exact, per-expert linear) | {res['scoring_ex_per_s']:.1f} | "
            f"{res['scoring_ex_per_s'] * mean_len:.0f} |")
    for k in ("train_fused", "train_eager"):
        if res[k]["ex_per_s"] is None:
            log(f"| training step ({k[6:]} experts, fwd+bwd) | {res[k]['error']} | |")
            continue
        log(f"| training step ({k[6:]} experts, fwd+bwd) | {res[k]['ex_per_s']:.1f} | "
            f"{res[k]['tokens_per_s']:.0f} |")
    if a.json:
        a.json.write_text(json.dumps(res, indent=2, default=str))
        log(f"wrote {a.json}")


if __name__ == "__main__":
    main()
