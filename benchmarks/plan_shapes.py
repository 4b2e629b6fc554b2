"""Memory plans of real model shapes without a GPU or weights: the model is built on the
``meta`` device from its config and :func:`prism_select.plan.make_plan` is asked what a
run would hold on a device of ``--gpu-gib`` with one example of ``--tokens`` taking the
activation bytes measured at 8B (scaled by hidden size and layer count). Prints a table
and writes JSON; used for docs/scale.md (the 14B and 70B plans).

    python benchmarks/plan_shapes.py --shapes llama8b qwen14b llama70b --gpu-gib 79.6 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from scale_setup import ADAPTERS, SHAPES  # noqa: E402

SHAPES = {**SHAPES, "llama70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                     num_attention_heads=64, num_key_value_heads=8, vocab_size=128256)}
#: measured on the 8B shape (run.json memory_plan.example_activations, scale suite): one
#: example of 512 tokens, forward + activation backward, bf16
EXAMPLE_BYTES_8B = 2_588_416_000
GiB = 1 << 30


def meta_model(shape: str, adapter: str | None):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(**SHAPES[shape], tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    if adapter:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(**ADAPTERS[adapter], lora_dropout=0.0))
    return model, cfg


def plan_for(shape: str, adapter: str | None, gpu_gib: float, host_gib: float, ranks: int):
    from prism_select.model import tracked_linear_modules
    from prism_select.plan import ExampleSize, PlanError, make_plan
    model, cfg = meta_model(shape, adapter)
    modules = tracked_linear_modules(model)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    scale = (cfg.hidden_size * cfg.num_hidden_layers) / (4096 * 32)
    example = int(EXAMPLE_BYTES_8B * scale)
    row = {"shape": shape, "adapter": adapter or "full", "ranks": ranks, "weights_gib": weights / GiB,
           "tracked_layers": len(modules)}
    try:
        # sharded over `ranks` GPUs (FSDP): weights, V and factors divide by the ranks
        plan = make_plan(model, modules, kind="ekfac", device="cuda", batch_size=8, fit_batch_size=8,
                         example=ExampleSize(example, 512, cfg.vocab_size),
                         gpu_total=int(gpu_gib * GiB * ranks), weights=weights, host_available=int(host_gib * GiB))
        row.update(groups=len(plan.fit_groups), store=plan.curvature_store, peak_gib=plan.peak / GiB,
                   curvature_gib=plan.fit["stored_bytes"] / GiB, notes=plan.notes)
    except PlanError as exc:
        row.update(error=str(exc).split(";")[0])
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["llama8b", "qwen14b", "llama70b"])
    ap.add_argument("--adapters", nargs="*", default=[None, "lora-qkvo128", "lora-all32"])
    ap.add_argument("--gpu-gib", type=float, default=79.6)
    ap.add_argument("--host-gib", type=float, default=123.0)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1])
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = [plan_for(s, None if ad in (None, "full", "None") else ad, a.gpu_gib, a.host_gib, k)
            for s in a.shapes for ad in a.adapters for k in a.ranks]
    print("| shape | adapter | GPUs | weights GiB | layers | fit groups | curvature GiB | kept | planned peak GiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['shape']} | {r['adapter']} | {r['ranks']} | {r['weights_gib']:.1f} | {r['tracked_layers']} | "
                  f"does not fit: {r['error']} | | | |")
        else:
            print(f"| {r['shape']} | {r['adapter']} | {r['ranks']} | {r['weights_gib']:.1f} | {r['tracked_layers']} | "
                  f"{r['groups']} | {r['curvature_gib']:.1f} | {r['store']} | {r['peak_gib']:.1f} |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
