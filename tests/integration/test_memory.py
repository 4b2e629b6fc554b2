"""The streaming scorer (pool read a window at a time, host memory flat in pool size)
gives the in-memory scorer's scores. The RSS measurement itself is
benchmarks/bench_memory.py (10K / 100K / 1M records), not a test."""

import json

import torch

from prism_select.data.tokenize import encode
from prism_select.scoring import Chunking, score_encoded, score_stream


def _write_pool(path, pool_examples, n):
    recs = []
    with open(path, "w") as f:
        for i in range(n):
            p, r = pool_examples[i % len(pool_examples)]
            rec = {"id": f"r{i}", "prompt": p + "!" * (i % 5), "response": r + "." * (i % 3)}
            recs.append(rec)
            f.write(json.dumps(rec) + "\n")
    return recs


def _direction(modules):
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(m.out_features, m.in_features, generator=g, dtype=torch.float64)
            for n, m in modules.items()}


def test_stream_equals_in_memory(tmp_path, model, modules, tok, pool_examples):
    recs = _write_pool(tmp_path / "pool.jsonl", pool_examples, 30)
    V = _direction(modules)
    enc = [encode(tok, r["prompt"], r["response"]) for r in recs]
    ref = score_encoded(model, modules, enc, V, pad_id=tok.pad_token_id, batch_size=4, chunking=Chunking(8))
    # one window holding the whole pool: the same chunks and batches, bit-identical
    info = score_stream(model, tok, modules, V, tmp_path / "pool.jsonl", tmp_path / "a.jsonl", batch_size=4,
                        chunking=Chunking(8), window=1000)
    assert info["count"] == 30
    a = [json.loads(l) for l in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert [x["id"] for x in a] == [r["id"] for r in recs]
    assert torch.equal(torch.tensor([x["score"] for x in a], dtype=torch.float64), ref)
    order = sorted(range(len(recs)), key=lambda i: -float(ref[i]))  # rank 1 = the in-memory scorer's highest
    assert [a[i]["rank"] for i in order] == list(range(1, len(recs) + 1))
    # small windows (other batch composition): equal to float64 rounding, same ranks
    score_stream(model, tok, modules, V, tmp_path / "pool.jsonl", tmp_path / "b.jsonl", batch_size=3,
                 chunking=Chunking(4, tmp_path / "partial", {"k": 1}), window=7)
    b = [json.loads(l) for l in (tmp_path / "b.jsonl").read_text().splitlines()]
    assert torch.allclose(torch.tensor([x["score"] for x in b], dtype=torch.float64), ref, rtol=1e-10, atol=0)
    assert [x["rank"] for x in b] == [x["rank"] for x in a]
    # a rerun with the same partial dir reuses every saved chunk (resume path)
    score_stream(model, tok, modules, V, tmp_path / "pool.jsonl", tmp_path / "c.jsonl", batch_size=3,
                 chunking=Chunking(4, tmp_path / "partial", {"k": 1}), window=7)
    assert (tmp_path / "c.jsonl").read_text() == (tmp_path / "b.jsonl").read_text()
