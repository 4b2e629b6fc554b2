"""Make what the multi-GPU benchmark scores: a random-init Llama saved as a Hugging Face
directory (with a small character-level chat tokenizer, so nothing is downloaded), a
synthetic pool and synthetic target pairs.

    python benchmarks/dist_setup.py --config 0.3b --out /tmp/dist --pool 2048 --chars 900
    for K in 1 2 4; do
      torchrun --nproc-per-node $K -m prism_select.cli score --model /tmp/dist/model \\
        --pool /tmp/dist/pool.jsonl --targets /tmp/dist/targets.jsonl --out /tmp/dist/run$K \\
        --cache-dir /tmp/dist/cache$K --batch-size 16 --chunk-size 128 --no-progress
    done
    python benchmarks/dist_report.py /tmp/dist/run1 /tmp/dist/run2 /tmp/dist/run4
"""

import argparse
import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

WORDS = ("the of and to in is was for on that with as by at from his her an were which this be are "
         "number answer total each more than half twice apples books miles hours dollars").split()


def text(rng, n_chars):
    out = []
    while sum(len(w) + 1 for w in out) < n_chars:
        out.append(rng.choice(WORDS) if rng.random() > 0.15 else str(rng.randint(0, 999)))
    return " ".join(out)[:n_chars]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="0.3b")
    ap.add_argument("--out", required=True)
    ap.add_argument("--pool", type=int, default=2048)
    ap.add_argument("--targets", type=int, default=32)
    ap.add_argument("--chars", type=int, default=900, help="approximate characters (= tokens) per record")
    a = ap.parse_args()
    from bench_scoring import CONFIGS
    from tiny import tiny_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = tiny_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(**{**CONFIGS[a.config], "vocab_size": max(CONFIGS[a.config]["vocab_size"], len(tok))},
                      max_position_embeddings=2048, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out / "model")
    tok.save_pretrained(out / "model")
    rng = random.Random(0)
    with open(out / "pool.jsonl", "w") as f:
        for i in range(a.pool):
            n = rng.randint(a.chars // 2, a.chars)
            f.write(json.dumps({"id": f"p{i}", "prompt": text(rng, n // 3), "response": text(rng, n - n // 3)}) + "\n")
    with open(out / "targets.jsonl", "w") as f:
        for i in range(a.targets):
            q = text(rng, 200)
            f.write(json.dumps({"id": f"t{i}", "prompt": q, "chosen": text(rng, 300), "rejected": text(rng, 300)}) + "\n")
    print(f"wrote {out}/model, pool.jsonl ({a.pool}), targets.jsonl ({a.targets})")


if __name__ == "__main__":
    main()
