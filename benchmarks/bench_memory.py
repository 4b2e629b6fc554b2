"""Host memory against pool size: peak RSS of streamed scoring (``score_stream``) of a
synthetic pool of 10K / 100K / 1M records with a tiny model on the CPU, each size in a
fresh process; for contrast, the in-memory route (read + tokenise the whole pool, then
``score_encoded``) at the smaller sizes.

    python benchmarks/bench_memory.py --sizes 10000,100000,1000000 --json mem.json

Peak RSS is ``ru_maxrss`` of the child process (whole run: imports, model, scoring,
writing scores.jsonl).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def make_pool(path: Path, n: int, seed: int = 0):
    rng = random.Random(seed)
    words = "the a of to and is was in for on number total each more less half apples books miles".split()
    with open(path, "w") as f:
        for i in range(n):
            p = " ".join(rng.choice(words) for _ in range(rng.randint(2, 6)))
            r = " ".join(rng.choice(words) for _ in range(rng.randint(2, 8)))
            f.write(json.dumps({"id": i, "prompt": p, "response": r}) + "\n")


def child(a):
    import torch
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tests"))
    torch.set_num_threads(1)
    from prism_select.data.tokenize import encode
    from prism_select.runtime.execution import ExecutionContext
    from prism_select.scoring import Chunking, score_encoded, score_stream
    from tiny import tiny_llama, tiny_tokenizer
    tok = tiny_tokenizer()
    model = tiny_llama(len(tok), dtype=torch.float32, layers=2, hidden=16)
    modules = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n}
    g = torch.Generator().manual_seed(0)
    V = {n: torch.randn(m.out_features, m.in_features, generator=g) for n, m in modules.items()}
    t = time.perf_counter()
    if a.mode == "stream":
        info = score_stream(model, tok, modules, V, a.pool, a.out, batch_size=a.batch, window=a.window,
                            chunking=Chunking(a.chunk),
                            execution=ExecutionContext.of(model, "cpu", progress=False))
        n = info["count"]
    else:
        from prism_select.data.readers import load_pool
        pool = load_pool(a.pool).items
        enc = [encode(tok, e.prompt, e.response) for e in pool]
        s = score_encoded(model, modules, enc, V, pad_id=tok.pad_token_id, batch_size=a.batch,
                          chunking=Chunking(a.chunk), execution=ExecutionContext.of(model, progress=False))
        with open(a.out, "w") as f:
            for e, x in zip(pool, s.tolist()):
                f.write(json.dumps({"id": e.id, "score": x}) + "\n")
        n = len(pool)
    dt = time.perf_counter() - t
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB (Linux: KiB)
    print(json.dumps({"mode": a.mode, "records": n, "peak_rss_mib": rss, "seconds": dt}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--memory-sizes", default="10000,100000", help="sizes also run with the in-memory route")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--window", type=int, default=16384)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--dir", default="/tmp/prism-bench-memory")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="stream", help=argparse.SUPPRESS)
    ap.add_argument("--pool", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a)
    d = Path(a.dir)
    d.mkdir(parents=True, exist_ok=True)
    rows = []
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    mem_sizes = {int(x) for x in a.memory_sizes.split(",") if x}
    for n in [int(x) for x in a.sizes.split(",") if x]:
        pool = d / f"pool_{n}.jsonl"
        if not pool.exists():
            make_pool(pool, n)
        for mode in ["stream"] + (["memory"] if n in mem_sizes else []):
            cmd = [sys.executable, __file__, "--child", "--mode", mode, "--pool", str(pool),
                   "--out", str(d / f"scores_{mode}_{n}.jsonl"), "--batch", str(a.batch),
                   "--window", str(a.window), "--chunk", str(a.chunk)]
            r = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if r.returncode != 0:
                print(r.stderr[-2000:])
                continue
            row = json.loads(r.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(f"{mode:>6} {row['records']:>8} records: peak RSS {row['peak_rss_mib']:8.1f} MiB, "
                  f"{row['seconds']:7.1f} s", flush=True)
    print("| route | records | peak RSS MiB | seconds |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['records']} | {r['peak_rss_mib']:.1f} | {r['seconds']:.1f} |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
