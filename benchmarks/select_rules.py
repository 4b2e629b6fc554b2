"""Time `select`'s rules on a generated pool (no model): plain top-k, --stratify, --dedup,
--exclude-overlap, and all of them, side by side.

    python benchmarks/select_rules.py --n 20000 --out benchmarks/results/select_rules.json

The pool's records are random word sequences (a prompt and a response of ``--words`` words
each) with 2% exact copies and 2% one-word edits of an earlier record planted, scored in a
random order; the targets are 200 pairs, 1% of the pool a one-word edit of a target prompt.
``rule_drops`` counts the duplicate / overlap drops whose ``of`` is right (a record of the
same planted group, or the target copied) and wrong.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prism_select.io import sha256_file  # noqa: E402
from prism_select.selection import select  # noqa: E402


def build(root: Path, n: int, words: int, seed: int):
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(5000)]

    def text(k):
        return " ".join(rng.choice(vocab) for _ in range(k))

    targets = [{"id": f"t{i}", "prompt": text(words), "chosen": text(20), "rejected": text(20)} for i in range(200)]
    pool = []
    for i in range(n):
        u = rng.random()
        if u < 0.02 and pool:
            src = rng.choice(pool)
            pool.append({**src, "id": f"r{i}"})  # src's group
        elif u < 0.04 and pool:
            src = rng.choice(pool)
            w = src["response"].split()
            w[rng.randrange(len(w))] = "edited"
            pool.append({**src, "id": f"r{i}", "response": " ".join(w)})
        elif u < 0.05:
            t = rng.choice(targets)
            w = t["prompt"].split()
            w[rng.randrange(len(w))] = "edited"
            pool.append({"id": f"r{i}", "prompt": " ".join(w), "response": text(words), "group": f"r{i}",
                         "target": t["id"]})
        else:
            pool.append({"id": f"r{i}", "prompt": text(words), "response": text(words), "group": f"r{i}"})
        pool[-1]["source"] = f"s{rng.randrange(4)}"
    pool_path, targets_path = root / "pool.jsonl", root / "targets.jsonl"
    pool_path.write_text("".join(json.dumps(r) + "\n" for r in pool))
    targets_path.write_text("".join(json.dumps(r) + "\n" for r in targets))
    order = list(range(n))
    rng.shuffle(order)
    run = root / "run"
    run.mkdir()
    (run / "scores.jsonl").write_text("".join(
        json.dumps({"id": f"r{i}", "score": float(n - r), "rank": r + 1}) + "\n" for r, i in enumerate(order)))
    (run / "run.json").write_text(json.dumps({"status": "complete",
                                              "inputs": {"pool": str(pool_path), "targets": str(targets_path)},
                                              "fingerprints": {"pool_file": sha256_file(pool_path)}}))
    return run, pool_path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--words", type=int, default=60)
    ap.add_argument("--keep", default="10%")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON results file")  # planted kinds counted per reason
    a = ap.parse_args()
    cases = {"top-k": {}, "stratify": {"stratify": "source"}, "dedup": {"dedup": True},
             "exclude-overlap": {"exclude_overlap": True},
             "all": {"stratify": "source", "dedup": True, "exclude_overlap": True}}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        run, pool = build(Path(tmp), a.n, a.words, a.seed)
        for name, rules in cases.items():
            t0 = time.perf_counter()
            s = select(run, pool, Path(tmp) / f"{name}.jsonl", keep=a.keep, **rules)
            seconds = round(time.perf_counter() - t0, 2)
            recs = {r["id"]: r for r in map(json.loads, pool.open())}
            right = wrong = 0  # drops whose `of` is a record of the same group, or the target copied
            for line in open(s["decisions"]):
                d = json.loads(line)
                if d["reason"] in ("duplicate", "near_duplicate", "overlap"):
                    r = recs[d["id"]]
                    ok = (d["of"] == f"target:{r.get('target')}" if d["reason"] == "overlap"
                          else recs[d["of"]]["group"] == r["group"])
                    right, wrong = right + ok, wrong + (not ok)
            caught = {"right": right, "wrong": wrong}
            rows.append({"case": name, "seconds": seconds, "kept": s["kept"], "drop": s["counts"]["drop"],
                         "rule_drops": caught})
    groups = len({r["group"] for r in recs.values()})
    planted_targets = sum("target" in r for r in recs.values())
    print(f"planted: {a.n - groups} copies or one-word edits of another record, {planted_targets} near-copies "
          "of a target prompt")
    print(f"{'case':<16}{'seconds':>9}{'kept':>7}  dropped by reason")
    for r in rows:
        print(f"{r['case']:<16}{r['seconds']:>9.2f}{r['kept']:>7}  {r['drop']}  {r['rule_drops']}")
    if a.out:
        import datetime
        import os
        import subprocess

        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip()
        Path(a.out).write_text(json.dumps({
            "n": a.n, "planted_copies": a.n - groups, "planted_target_copies": planted_targets, "words": a.words, "keep": a.keep, "rows": rows, "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
            "device": f"CPU ({os.cpu_count()} cores, {platform.machine()})",
            "python": platform.python_version()}, indent=2) + "\n")


if __name__ == "__main__":
    main()
