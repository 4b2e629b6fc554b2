"""Resident memory after each step of importing and running a small model on the CPU, split
into anonymous and file-backed pages, so that two PyTorch builds (a CPU-only and a CUDA one)
can be compared on the same work:

    python benchmarks/rss_imports.py OUT.json

The steps: import torch; one matmul and one ``eigh``; import transformers; a random-init
model of the embedded SmolLM2-135M's shape in float32; one forward and backward (the
model's own loss) of 8 x 150 random tokens. Prints a table and writes OUT.json (optional).
"""

from __future__ import annotations

import json
import sys

FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM")


def status() -> dict:
    """This process's resident-memory fields of ``/proc/self/status``, MiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in FIELDS:
                out[key] = int(value.split()[0]) // 1024
    return out


def main():
    rows = [("start", status())]
    import torch  # the imports are measured: they happen here, in order
    rows.append((f"import torch {torch.__version__}", status()))
    x = torch.randn(512, 512)
    (x @ x).sum()
    torch.linalg.eigh(x @ x.T)
    rows.append(("a matmul and an eigh", status()))
    import transformers
    rows.append((f"import transformers {transformers.__version__}", status()))
    from transformers import LlamaConfig, LlamaForCausalLM
    model = LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                         tie_word_embeddings=True))
    rows.append(("SmolLM2-135M shape built (float32)", status()))
    ids = torch.randint(0, 49152, (8, 150))
    model(input_ids=ids, labels=ids).loss.backward()
    rows.append(("forward + backward, 8 x 150 tokens", status()))
    for label, values in rows:
        print(f"{label:45s} " + "  ".join(f"{k} {v:6d}" for k, v in values.items()))
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
