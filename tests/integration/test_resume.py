"""SIGKILL the `score` command at different points and run it again: it continues from
the saved chunks and writes scores identical, bit for bit, to an uninterrupted run."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from prism_select.runtime.execution import ExecutionContext

HERE = Path(__file__).resolve().parents[1]  # tests/
ROOT = HERE.parent


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    sys.path.insert(0, str(HERE))
    from conftest import PAIRS, POOL
    from tiny import tiny_llama, tiny_tokenizer
    d = tmp_path_factory.mktemp("resume")
    tok = tiny_tokenizer()
    model = tiny_llama(len(tok), dtype=torch.float32, layers=2, hidden=32)
    model.save_pretrained(d / "model")
    tok.save_pretrained(d / "model")
    with open(d / "pool.jsonl", "w") as f:
        for i in range(240):
            p, r = POOL[i % len(POOL)]
            f.write(json.dumps({"id": i, "prompt": p + " #" * (i % 7), "response": r + " ." * (i % 11)}) + "\n")
    with open(d / "targets.jsonl", "w") as f:
        for q, c, r in PAIRS:
            f.write(json.dumps({"prompt": q, "chosen": c, "rejected": r}) + "\n")
    return d


def _cmd(d, out):
    return [sys.executable, "-m", "prism_select.cli", "score", "--model", str(d / "model"),
            "--pool", str(d / "pool.jsonl"), "--targets", str(d / "targets.jsonl"), "--out", str(out),
            "--cache-dir", str(out) + "-cache", "--batch-size", "2", "--chunk-size", "4",
            "--no-progress", "--device", "cpu", "--dtype", "float32"]


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1",
                TRANSFORMERS_OFFLINE="1")


def _scores(out):
    return [json.loads(l) for l in (out / "scores.jsonl").read_text().splitlines()]


def _run(cmd):
    r = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


def _kill_when(cmd, ready, timeout=120):
    """Start ``cmd``, SIGKILL it as soon as ``ready()`` holds; True if it was killed."""
    p = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0 = time.time()
    try:
        while p.poll() is None and time.time() - t0 < timeout:
            if ready():
                p.send_signal(signal.SIGKILL)
                p.wait()
                return True
            time.sleep(0.005)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return False


def test_sigkill_and_resume_is_bit_identical(setup, tmp_path):
    d = setup
    ref = tmp_path / "ref"
    # the uninterrupted reference in this process (one thread, as the commands below): a
    # process of its own would only add the imports
    from prism_select.cli import main
    assert main(_cmd(d, ref)[3:]) == 0
    out = tmp_path / "out"
    chunks = out / ".partial" / "scores"
    n_chunks = lambda: len(list(chunks.glob("chunk_*.safetensors"))) if chunks.exists() else 0  # noqa: E731
    # 1) killed early (curvature fit / before any chunk), 2) and 3) killed among the chunks
    killed = [_kill_when(_cmd(d, out), lambda: (out / ".partial" / "key.json").exists())]
    for k in (3, 20):
        before = n_chunks()
        killed.append(_kill_when(_cmd(d, out), lambda: n_chunks() >= before + k))
        if not killed[-1]:
            break
    assert killed[0] and killed[1], "the run finished before it could be killed"
    assert n_chunks() > 0 and not (out / "run.json").exists()
    _run(_cmd(d, out))
    a, b = _scores(ref), _scores(out)
    assert [r["id"] for r in a] == [r["id"] for r in b]
    assert [r["score"] for r in a] == [r["score"] for r in b]  # bit for bit
    assert [r["rank"] for r in a] == [r["rank"] for r in b]
    assert not (out / ".partial").exists()
    meta = json.loads((out / "run.json").read_text())  # the resumed run still says which curvature
    assert meta["curvature"]["kind"] == json.loads((ref / "run.json").read_text())["curvature"]["kind"]


def test_cpu_chunks_keep_work_and_resume_identically(setup, tmp_path, monkeypatch):
    """On the CPU the default chunks are capped by work (CPU_CHUNK_FLOPS), so an interrupted
    run keeps finished chunks even with the default --chunk-size, and the resumed scores
    are bit-identical to an uninterrupted run's."""
    sys.path.insert(0, str(ROOT))
    from prism_select import scoring
    from prism_select.data import load_pool
    from prism_select.data.tokenize import encode
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(setup / "model", dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(setup / "model")
    enc = [encode(tok, ex.prompt, ex.response, 128) for ex in load_pool(setup / "pool.jsonl").items][:60]
    modules = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "layers" in n}
    V = {n: torch.randn(m.out_features, m.in_features, generator=torch.Generator().manual_seed(0))
         for n, m in modules.items()}
    params = sum(p.numel() for p in model.parameters())
    monkeypatch.setattr(scoring, "CPU_CHUNK_FLOPS", 4 * params * 200)  # 200 tokens a chunk
    assert scoring.chunk_token_limit(model, "cpu") == 200 and scoring.chunk_token_limit(model, "meta") is None
    kw = dict(pad_id=tok.pad_token_id, batch_size=4, execution=ExecutionContext.of(model, progress=False))
    ref = scoring.score_encoded(model, modules, enc, V, chunking=scoring.Chunking(dir=tmp_path / "ref", key={"k": 1}),
                                **kw)
    n_chunks = len(scoring.plan_chunks(enc, scoring.DEFAULT_CHUNK_SIZE, 1, 200)[0])
    assert n_chunks > 3 and len(list((tmp_path / "ref").glob("chunk_*"))) == n_chunks

    real_save, saved = scoring._save_chunk, []

    def save_then_stop(*a):
        real_save(*a)
        saved.append(1)
        if len(saved) == 2:
            raise KeyboardInterrupt
    monkeypatch.setattr(scoring, "_save_chunk", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        scoring.score_encoded(model, modules, enc, V, chunking=scoring.Chunking(dir=tmp_path / "out", key={"k": 1}),
                              **kw)
    assert len(list((tmp_path / "out").glob("chunk_*"))) == 2
    monkeypatch.setattr(scoring, "_save_chunk", real_save)
    out = scoring.score_encoded(model, modules, enc, V, chunking=scoring.Chunking(dir=tmp_path / "out", key={"k": 1}),
                                **kw)
    assert torch.equal(out, ref)
