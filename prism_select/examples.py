"""A small generated example: an arithmetic SFT pool with some wrong answers.

The pool mixes correct worked additions/multiplications with "mistake math"
records (a wrong result carried to the final answer, ``harmful: true``). The
target pairs describe the unwanted behaviour: ``chosen`` = a wrong solution,
``rejected`` = the correct one, so the top-scored pool records are the ones that
push the model toward mistakes (the repair use: remove the top).
"""

from __future__ import annotations

import random
from pathlib import Path

from .io import atomic_write_jsonl

NAMES = ["Ava", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hugo", "Iris", "Jon"]
ITEMS = ["apples", "books", "coins", "stickers", "marbles", "pencils", "cards", "shells"]


def _problem(rng: random.Random, wrong: bool) -> tuple[str, str]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(3, 60), rng.randint(2, 40)
    if rng.random() < 0.5:
        q = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?"
        true = a + b
        op = f"{a} + {b}"
    else:
        b = rng.randint(2, 9)
        q = f"{name} buys {b} boxes with {a} {item} in each box. How many {item} is that?"
        true = a * b
        op = f"{a} * {b}"
    ans = true
    if wrong:
        ans = true + rng.choice([-1, 1]) * rng.randint(1, 9)
    return q, f"We compute {op} = {ans}.\nThe answer is {ans}."


def make_example(directory, n_pool: int = 40, harmful_ratio: float = 0.25, n_pairs: int = 8,
                 seed: int = 0) -> tuple[Path, Path]:
    """Write ``pool.jsonl`` and ``targets.jsonl`` into ``directory``; return their paths."""
    rng = random.Random(seed)
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    n_bad = round(n_pool * harmful_ratio)
    flags = [True] * n_bad + [False] * (n_pool - n_bad)
    rng.shuffle(flags)
    pool = []
    for i, bad in enumerate(flags):
        q, a = _problem(rng, bad)
        pool.append({"id": f"ex{i:04d}", "prompt": q, "response": a, "harmful": bad})
    pairs = []
    for i in range(n_pairs):
        state = rng.getstate()
        q, wrong = _problem(rng, True)
        rng.setstate(state)
        _, right = _problem(rng, False)
        pairs.append({"id": f"t{i:03d}", "prompt": q, "chosen": wrong, "rejected": right})
    pool_path, targets_path = d / "pool.jsonl", d / "targets.jsonl"
    atomic_write_jsonl(pool_path, pool)
    atomic_write_jsonl(targets_path, pairs)
    return pool_path, targets_path
