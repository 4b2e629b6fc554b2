"""Several target sets in one scoring pass: the pool's scoring along k = 1, 4, 16 stacked
directions, side by side in one process on the same model, pool and batches.

Each k scores the same pool with ``score_encoded`` along k random directions stacked per
layer (``K x out x in``), which is the pass a ``score --targets A ... `` run of k target
sets makes (the per-task directions and their preconditioning are outside this pass: they
cost what k runs' would, on the target pairs only). Reports wall seconds, examples/s, the
ratio to k = 1 (goal: 4 sets <= 1.25x, 16 <= 2x), that column 0 of every k equals the
k = 1 scores, and on CUDA the peak memory beside the memory plan's figure
(:func:`prism_select.plan.make_plan` with ``directions=k``). JSON (``--json``) and a
markdown table (``--md``), each with the date, device and commit.

Models: ``--model default`` (the embedded SmolLM2-135M-Instruct GGUF, float32 on the CPU)
or ``--model random --shape 0.3b|llama8b|smol`` (random init in ``--dtype``). ``--modules``
restricts the tracked layers (k float32 directions of all 106M tracked weights of the
embedded model are 6.8 GB at k = 16, so the CPU run tracks its last eight blocks).

    nice python benchmarks/multitarget.py --model default --modules 'layers\\.(2[2-9])\\.' --n 16 --batch 4 \\
        --ks 1 4 16 1 --json benchmarks/results/multitarget_cpu.json --md benchmarks/results/multitarget_cpu.md
    # one GPU, random init at the 0.3B shape (every linear layer tracked) and the 8B shape
    # (q and v projections tracked: k full-model directions of 8B do not fit one card)
    python benchmarks/multitarget.py --model random --shape 0.3b --device cuda --pool gsm8k.jsonl --n 512 \\
        --batch 16 --ks 1 4 16 1 --json OUT/multitarget_03b.json --md OUT/multitarget_03b.md
    python benchmarks/multitarget.py --model random --shape llama8b --device cuda --pool gsm8k.jsonl --n 128 \\
        --batch 8 --modules 'self_attn\\.(q|v)_proj' --ks 1 4 16 1 --json OUT/multitarget_8b.json --md OUT/multitarget_8b.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from prism_select.data.tokenize import encode  # noqa: E402
from prism_select.runtime.execution import ExecutionContext  # noqa: E402
from prism_select.model import ModelSettings, load_model, tracked_linear_modules  # noqa: E402
from prism_select.plan import ExampleSize, PlanError, make_plan, measure_example_bytes  # noqa: E402
from prism_select.scoring import score_encoded  # noqa: E402

SHAPES = {
    "smol": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, vocab_size=49152),
    "0.3b": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16,
                 num_key_value_heads=16, vocab_size=32000),
    "llama8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
}
DEFAULT_POOL = Path("/work/shared/data/gsm8k/train.jsonl")


def _commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _model(a):
    if a.model == "default":
        lm = load_model(ModelSettings(model="default", device=a.device, dtype=a.dtype or "auto"))
        return lm.model, lm.tokenizer, "embedded SmolLM2-135M-Instruct (GGUF)"
    from transformers import LlamaConfig, LlamaForCausalLM
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny import tiny_tokenizer  # character-level, built in-process
    tok = tiny_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(**SHAPES[a.shape], max_position_embeddings=4096, tie_word_embeddings=False)
    dtype = getattr(torch, a.dtype or ("bfloat16" if a.device == "cuda" else "float32"))
    with torch.device(a.device):
        model = LlamaForCausalLM(cfg).to(dtype).eval()
    return model, tok, f"random-init Llama, {a.shape} shape"


def _pool(tok, a) -> list:
    rows = []
    if a.pool and Path(a.pool).exists():
        for line in Path(a.pool).read_text().splitlines()[:a.n]:
            r = json.loads(line)
            rows.append((r.get("question") or r.get("prompt"), r.get("answer") or r.get("response")))
    else:
        from prism_select.examples import make_example
        import tempfile
        pool, _ = make_example(tempfile.mkdtemp(), n_pool=a.n)
        rows = [(r["prompt"], r["response"]) for r in map(json.loads, pool.read_text().splitlines())]
    return [encode(tok, q, y, a.max_length) for q, y in rows]


def _directions(modules: dict, k: int, dtype, device, stacked: bool = False) -> dict:
    """k random directions stacked per layer; direction j is the same for every k. One
    direction is a ``out x in`` matrix (the one-set route), or with ``stacked`` a
    ``1 x out x in`` stack (the several-set route with k = 1)."""
    gens = [torch.Generator().manual_seed(1000 + j) for j in range(k)]
    out = {}
    for n, m in modules.items():
        shape = (m.out_features, m.in_features + (m.bias is not None))
        V = torch.stack([torch.randn(shape, generator=g) for g in gens]).to(dtype)
        out[n] = (V[0] if k == 1 and not stacked else V).to(device)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", choices=["default", "random"])
    p.add_argument("--shape", default="smol", choices=list(SHAPES))
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="float32 / bfloat16 (default: the model's, bf16 for random on cuda)")
    p.add_argument("--modules", nargs="*", default=None, metavar="REGEX", help="tracked layers (default: all)")
    p.add_argument("--pool", default=str(DEFAULT_POOL), help="GSM8K-style jsonl (question/answer); else generated")
    p.add_argument("--n", type=int, default=16, help="pool records")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--ks", nargs="+", default=["1", "4", "16"],
                   help="numbers of directions; '1s': one direction through the several-set route (a 1 x out x in "
                        "stack), to tell the route's cost from k's")
    p.add_argument("--json", default=None)
    p.add_argument("--md", default=None)
    a = p.parse_args(argv)
    torch.set_grad_enabled(False)
    model, tok, what = _model(a)
    dev = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    modules = tracked_linear_modules(model, a.modules)
    encoded = _pool(tok, a)
    tracked = sum(m.weight.numel() for m in modules.values())
    ex = ExecutionContext.of(model, progress=False)
    longest = max(encoded, key=lambda e: len(e.input_ids))
    example_bytes = measure_example_bytes(model, longest, tok.pad_token_id, dev) if dev.type == "cuda" else 0
    head = model.get_output_embeddings()
    print(f"{what}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, {len(modules)} tracked "
          f"layers ({tracked / 1e6:.1f}M), {len(encoded)} records, "
          f"{sum(len(e.input_ids) for e in encoded)} tokens, {dev}, {dtype}", flush=True)
    # one untimed pass over the whole pool first: the first pass of a process grows the
    # allocator and thread pools for every length (it took 2x the later ones on the CPU)
    score_encoded(model, modules, encoded, _directions(modules, 1, dtype, dev), pad_id=tok.pad_token_id,
                  batch_size=a.batch, execution=ex)
    rows, ref = [], None
    for label in a.ks:
        k, stacked = int(str(label).rstrip("s")), str(label).endswith("s")
        try:
            plan = make_plan(model, modules, kind="ekfac", device=dev, batch_size=a.batch, fit_batch_size=a.batch,
                             example=ExampleSize(example_bytes, len(longest.input_ids), head.out_features),
                             directions=k).scoring
        except PlanError as e:
            rows.append({"k": k, "skipped": f"does not fit per the memory plan: {e}"})
            print(f"k={k}: skipped ({e})", flush=True)
            continue
        V = _directions(modules, k, dtype, dev, stacked)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        score_encoded(model, modules, encoded[:a.batch], V, pad_id=tok.pad_token_id, batch_size=a.batch,
                      execution=ex)  # warm-up
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t = time.perf_counter()
        s = score_encoded(model, modules, encoded, V, pad_id=tok.pad_token_id, batch_size=a.batch, execution=ex)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        dt = time.perf_counter() - t
        s = s.reshape(len(encoded), -1)
        if ref is None:
            ref = s[:, 0].clone()
        err = float((s[:, 0] - ref).norm() / ref.norm())
        row = {"k": k, "route": "several-set (stacked)" if stacked or k > 1 else "one-set", "seconds": dt,
               "examples_per_s": len(encoded) / dt, "ratio_to_k1": None,
               "column0_rel_err_vs_k1": err, "v_bytes_plan": plan["v_bytes"], "scoring_peak_plan": plan["peak"],
               "host_maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
        if dev.type == "cuda":
            row["gpu_peak_bytes"] = torch.cuda.max_memory_allocated(dev)
            row["within_plan"] = row["gpu_peak_bytes"] <= plan["peak"]
        rows.append(row)
        del V
        print(json.dumps(row), flush=True)
    def mean(xs):
        return sum(xs) / len(xs) if xs else None

    # the baselines: the mean of the k = 1 rows of each route (a shared machine's noise
    # spreads over the repeats that --ks lists)
    base = mean([r["seconds"] for r in rows if r.get("route") == "one-set"])
    base_s = mean([r["seconds"] for r in rows if r.get("k") == 1 and r.get("route", "").startswith("several")])
    for r in rows:
        if "seconds" in r:
            r["ratio_to_k1"] = r["seconds"] / base if base else None
            r["ratio_to_k1_stacked"] = r["seconds"] / base_s if base_s else None
    goals = {4: 1.25, 16: 2.0}
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": _commit(), "model": what, "device": str(dev) if dev.type != "cpu" else
            f"CPU ({torch.get_num_threads()} threads, {platform.processor() or platform.machine()})",
            "dtype": str(dtype), "tracked_layers": len(modules), "tracked_params": tracked, "modules": a.modules,
            "records": len(encoded), "tokens": sum(len(e.input_ids) for e in encoded), "batch": a.batch,
            "torch": torch.__version__, "command": " ".join(sys.argv)}
    out = {**meta, "rows": rows, "goals": goals}
    lines = [f"Several target sets in one scoring pass: {meta['model']}, {meta['device']}, {meta['dtype']}, "
             f"{len(modules)} tracked layers ({tracked / 1e6:.1f}M weights), {meta['records']} records "
             f"({meta['tokens']} tokens), batch {a.batch}; {meta['date']}, commit {meta['commit']}.", "",
             "k = 1s: one direction through the several-set route (a 1 x out x in stack); x k=1 and x k=1s: "
             "against the mean of the k = 1 and of the k = 1s rows.", "",
             "| k | seconds | ex/s | x k=1 | x k=1s | goal | column 0 vs k=1 | plan: v | plan: peak | measured peak |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    def ratio(x):
        return "-" if x is None else f"{x:.2f}"

    for r in rows:
        if "seconds" not in r:
            lines.append(f"| {r['k']} | - | - | - | - | - | - | - | - | {r['skipped'][:60]} |")
            continue
        peak = (f"{r['gpu_peak_bytes'] / 2**30:.2f} GiB" if "gpu_peak_bytes" in r
                else f"RSS {r['host_maxrss_mib']:.0f} MiB")
        goal = f"<= {goals[r['k']]}x" if r["k"] in goals else ""
        label = f"{r['k']}s" if r["route"] != "one-set" and r["k"] == 1 else str(r["k"])
        lines.append(f"| {label} | {r['seconds']:.1f} | {r['examples_per_s']:.2f} | {ratio(r['ratio_to_k1'])} "
                     f"| {ratio(r['ratio_to_k1_stacked'])} | {goal} | {r['column0_rel_err_vs_k1']:.1e} "
                     f"| {r['v_bytes_plan'] / 2**30:.2f} GiB | {r['scoring_peak_plan'] / 2**30:.2f} GiB | {peak} |")
    table = "\n".join(lines) + "\n"
    print(table)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    if a.md:
        Path(a.md).write_text(table)


if __name__ == "__main__":
    main()
