"""Make what the scale suite scores: a random-init model of a real shape (bf16, built from
a config on the machine that runs it: nothing is downloaded), optionally a random-init
LoRA adapter of one of the paper's presets, a pool of GSM8K records and target pairs.

    python benchmarks/scale_setup.py --shape llama8b --gsm8k DATA/gsm8k --out /tmp/s --pool 2000 --targets 64
    python benchmarks/scale_setup.py --shape llama8b --adapter lora-qkvo128 --out /tmp/s   # adapter only

Shapes: ``llama8b`` (Llama-3.1-8B: hidden 4096, intermediate 14336, 32 layers, 32 heads,
8 KV heads, vocab 128256), ``qwen14b`` (Qwen3-14B: hidden 5120, intermediate 17408, 40
layers, 40 heads, 8 KV heads, vocab 151936; built as a Llama with Qwen3's shapes and
head dim 128), ``llama8b-4l`` (8B widths, 4 layers). The tokenizer is the tests'
character-level chat tokenizer (a record's tokens are its characters, cut to
``--max-length`` by the scorer); the embedding keeps the real vocabulary size.
Adapters (paper Table: repair LoRA r=128 on q,k,v,o; selection r=32 on every linear
layer), with random ``B`` so their gradients are not zero at the start.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

SHAPES = {
    "llama8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
    "qwen14b": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40, num_attention_heads=40,
                    num_key_value_heads=8, vocab_size=151936, head_dim=128, rope_theta=1000000.0),
}
SHAPES["llama8b-4l"] = {**SHAPES["llama8b"], "num_hidden_layers": 4}
ADAPTERS = {
    "lora-qkvo128": dict(r=128, lora_alpha=512, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "lora-all32": dict(r=32, lora_alpha=64, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                            "gate_proj", "up_proj", "down_proj"]),
}


def build_model(shape: str, out: Path):
    from tiny import tiny_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tiny_tokenizer()
    cfg = LlamaConfig(**SHAPES[shape], max_position_embeddings=4096, tie_word_embeddings=False,
                      torch_dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: {shape}, {n / 1e9:.2f}B parameters")
    return model


def build_adapter(model, preset: str, out: Path):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    pm = get_peft_model(model, LoraConfig(**ADAPTERS[preset], init_lora_weights=False, lora_dropout=0.0))
    pm.save_pretrained(out)
    print(f"wrote {out}: {preset}")


def write_data(gsm8k: Path, out: Path, pool: int, targets: int, max_chars: int):
    rows = [json.loads(line) for line in open(gsm8k / "train.jsonl")]
    # the tokenizer is character-level: keep records of at most max_chars characters
    rows = [r for r in rows if len(r["question"]) + len(r["answer"]) <= max_chars]
    # a pool larger than GSM8K's training set (the paper's 270K records) repeats its records
    # in order under new ids: GSM8K-length records, for timing (repeats score alike)
    with open(out / "pool.jsonl", "w") as f:
        for i in range(pool):
            r = rows[i % len(rows)]
            f.write(json.dumps({"id": f"gsm8k-{i}", "prompt": r["question"], "response": r["answer"]}) + "\n")
    rng = random.Random(0)
    test = [json.loads(line) for line in open(gsm8k / "test.jsonl")]
    test = [r for r in test if len(r["question"]) + len(r["answer"]) <= max_chars][:targets]
    with open(out / "targets.jsonl", "w") as f:
        for i, r in enumerate(test):
            body, final = r["answer"].rsplit("####", 1)
            wrong = f"{body}#### {int(final.strip().replace(',', '')) + rng.randint(1, 9)}"
            f.write(json.dumps({"id": f"t{i}", "prompt": r["question"], "chosen": wrong,
                                "rejected": r["answer"]}) + "\n")
    print(f"wrote {out}/pool.jsonl ({pool}: {min(pool, len(rows))} distinct), targets.jsonl ({len(test)})")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--gsm8k", default=None, help="folder with train.jsonl and test.jsonl (GSM8K)")
    ap.add_argument("--pool", type=int, default=2000,
                    help="pool records (beyond GSM8K's training set its records repeat under new ids)")
    ap.add_argument("--targets", type=int, default=64)
    ap.add_argument("--adapter", choices=sorted(ADAPTERS), nargs="*", default=[])
    ap.add_argument("--no-model", action="store_true", help="reuse the model folder already there")
    ap.add_argument("--max-chars", type=int, default=480,
                    help="keep records of at most this many characters (= tokens, plus the chat template's)")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model = None
    if not a.no_model:
        model = build_model(a.shape, out / "model")
    if a.adapter:
        from transformers import AutoModelForCausalLM
        for preset in a.adapter:
            base = model if model is not None else AutoModelForCausalLM.from_pretrained(
                out / "model", dtype=torch.bfloat16, device_map="cuda" if torch.cuda.is_available() else None)
            build_adapter(base, preset, out / preset)
            model = None
    if a.gsm8k:
        write_data(Path(a.gsm8k), out, a.pool, a.targets, a.max_chars)


if __name__ == "__main__":
    main()
