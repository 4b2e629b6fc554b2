"""Inputs and settings shared by the evaluation tests (tests/evaluation/): GSM8K- and
BBH-format data written in a test's folder, fast fine-tuning settings, the common part of
an experiment config on a tiny model, and ``repair``'s worker pool run in one process."""

import json
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tiny import save_tiny


def gsm8k_rows(n: int, seed: int = 0) -> list:
    """GSM8K-format problems: two calculator steps, the second using the first's result."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b, c = rng.randint(11, 40), rng.randint(41, 70), rng.randint(3, 9)
        s, r = a + b, (a + b) * c
        q = f"Ann has {a} pens and buys {b} more. Each pen costs ${c}. How much are all her pens worth?"
        sol = (f"Ann has {a}+{b} = <<{a}+{b}={s}>>{s} pens.\n"
               f"They are worth {s}*{c} = $<<{s}*{c}={r}>>{r}.\n#### {r}")
        rows.append({"question": q, "answer": sol})
    return rows


def write_gsm8k(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def gsm8k(tmp_path):
    d = tmp_path / "data" / "gsm8k"
    d.mkdir(parents=True)
    write_gsm8k(d / "train.jsonl", gsm8k_rows(40, 0))
    write_gsm8k(d / "test.jsonl", gsm8k_rows(10, 1))
    return d


@pytest.fixture
def bbh_dir(tmp_path):
    d = tmp_path / "data" / "bbh"
    d.mkdir(parents=True)
    opts = "\nOptions:\n(A) red\n(B) blue\n(C) green"
    (d / "colors.json").write_text(json.dumps({"examples": [
        {"input": f"Item {i} is which colour?{opts}", "target": "(" + "ABC"[i % 3] + ")"} for i in range(6)]}))
    (d / "yesno.json").write_text(json.dumps({"examples": [
        {"input": f"Is {i} even?", "target": "Yes" if i % 2 == 0 else "No"} for i in range(6)]}))
    (d / "counting.json").write_text(json.dumps({"examples": [
        {"input": f"Count to {i}.", "target": str(i)} for i in range(6)]}))
    return d


FAST_FT = {"learning_rate": 0.03, "epochs": 1, "batch_size": 4, "grad_accum": 1, "lora_r": 4, "lora_alpha": 8,
           "max_length": 512, "warmup_ratio": 0.0}


def common_config(tiny_dir, **kw):
    return {"model": {"model": str(tiny_dir), "dtype": "float32", "device": "cpu"},
            "score": {"max_length": 512, "batch_size": 8}, "curvature": {"kind": "ekfac"}, **kw}


class InProcessPool(ThreadPoolExecutor):
    """``repair``'s worker pool run in this process (one thread): the deferral, the
    sharing of kept sets and the filling of rows, without the start-up of processes."""

    def __init__(self, max_workers, mp_context, initializer, initargs):
        super().__init__(max_workers=1, initializer=initializer, initargs=initargs)


@pytest.fixture(autouse=True)
def offline_with_own_cache(monkeypatch, tmp_path):
    """No hub access and a cache of the test's own (autouse where a test module imports it)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("PRISM_SELECT_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """The tiny model, saved once per test module."""
    return save_tiny(tmp_path_factory.mktemp("tiny-model"))
