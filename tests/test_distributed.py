"""Two CPU processes (gloo, started by torchrun) give the single-process results:
curvature statistics all-reduced, the pool sharded by chunk, scores gathered in order."""

import json
import runpy
import sys
from pathlib import Path

import pytest
import torch

from torchrun import cli_args, task_args

def test_sharded_fit_and_scores_equal_single_process(two_ranks, tmp_path, monkeypatch):
    script = two_ranks / "worker.py"
    # one process without torchrun (under it, a world of 1 joins no process group either):
    # this one, as a process of its own would only add the imports
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(sys, "argv", [str(script), str(tmp_path / "one.json")])
    runpy.run_path(str(script), run_name="__main__")
    one = json.loads((tmp_path / "one.json").read_text())
    two = json.loads((two_ranks / "two.json").read_text())
    assert one["world"] == 1 and two["world"] == 2
    a, b = torch.tensor(one["scores"]), torch.tensor(two["scores"])
    assert torch.isfinite(b).all()
    assert torch.allclose(a, b, rtol=1e-9, atol=0), (a - b).abs().max()
    la, lb = torch.tensor(one["lam"]), torch.tensor(two["lam"])
    assert torch.allclose(la, lb, rtol=1e-9, atol=1e-15)


def test_cli_under_torchrun_matches_single_process(two_ranks, tmp_path):
    from prism_select.cli import main
    d = two_ranks
    # the one-process runs in this process (a process of their own only adds the imports)
    assert main(cli_args(d, tmp_path / "single", tmp_path / "c1")) == 0

    def read(d):
        return {json.loads(l)["id"]: json.loads(l) for l in (d / "scores.jsonl").read_text().splitlines()}
    s1, s2 = read(tmp_path / "single"), read(d / "multi")
    assert list(s1) == list(s2)  # pool order
    for k in s1:
        assert s2[k]["score"] == pytest.approx(s1[k]["score"], rel=1e-9, abs=1e-12)
    run = json.loads((d / "multi" / "run.json").read_text())
    assert run["distributed"]["world_size"] == 2
    assert not (d / "multi" / ".partial").exists()
    # the curvature was saved in two shares, one per rank; one process reuses it
    saved = Path(run["curvature"]["path"])
    assert sorted(p.name for p in saved.glob("factors*")) == [
        "factors-00000-of-00002.safetensors", "factors-00001-of-00002.safetensors"]
    assert set(run["curvature"]["phases_s"]) == {"factors_s", "eigh_s", "lambda_s"}
    assert main(cli_args(d, tmp_path / "reuse", d / "c2")) == 0
    again = json.loads((tmp_path / "reuse" / "run.json").read_text())
    assert again["curvature"]["reused"] is True
    s3 = read(tmp_path / "reuse")
    for k in s1:
        assert s3[k]["score"] == pytest.approx(s1[k]["score"], rel=1e-9, abs=1e-12)


def test_several_target_sets_under_torchrun_match_single_process(two_ranks, tmp_path):
    """Two target sets scored in one pass on two ranks: each rank's chunks hold both
    columns, gathered in pool order, equal to one process's."""
    from prism_select.cli import main
    d = two_ranks
    assert main(task_args(d, tmp_path / "single", tmp_path / "c1")) == 0

    def read(d):
        return [json.loads(l) for l in (d / "scores.jsonl").read_text().splitlines()]
    s1, s2 = read(tmp_path / "single"), read(d / "multi-tasks")
    assert [r["id"] for r in s1] == [r["id"] for r in s2]
    assert list(s2[0]["scores"]) == ["tasks-a", "tasks-b"]
    for a, b in zip(s1, s2):
        for task in ("tasks-a", "tasks-b"):
            assert b["scores"][task] == pytest.approx(a["scores"][task], rel=1e-9, abs=1e-12)
    assert json.loads((d / "multi-tasks" / "run.json").read_text())["distributed"]["world_size"] == 2
    assert any(a["scores"]["tasks-a"] != a["scores"]["tasks-b"] for a in s1)  # two directions, not one


def test_contiguous_owners_balance_cost_and_keep_order():
    from prism_select.runtime.distributed import contiguous_owners

    costs = [1.0] * 10 + [3.0] * 10  # rising lengths: equal counts would be 10 vs 30
    own = contiguous_owners(costs, 2)
    assert own == sorted(own) and set(own) == {0, 1}
    load = [sum(c for c, o in zip(costs, own) if o == r) for r in (0, 1)]
    assert abs(load[0] - load[1]) <= max(costs)
    assert contiguous_owners(costs, 1) == [0] * 20
    assert contiguous_owners([0.0] * 4, 2) == [0, 0, 1, 1]
    assert contiguous_owners([], 3) == []


def test_balance_spreads_large_tasks_first():
    from prism_select.runtime.distributed import balance

    # one layer group of a model: three big eighs and eight small ones, four ranks
    costs = [27.0, 1, 1, 1, 27.0, 1, 1, 1, 1, 1, 27.0]
    where = balance(costs, 4)
    big = [where[i] for i, c in enumerate(costs) if c == 27.0]
    assert len(set(big)) == 3  # never two big ones on one rank
    load = [sum(c for c, r in zip(costs, where) if r == k) for k in range(4)]
    assert max(load) == 27.0
    assert balance(costs, 4) == where  # deterministic


def test_plan_chunks_gives_each_rank_one_length_range():
    from prism_select.data.tokenize import Encoded
    from prism_select.scoring import plan_chunks

    lengths = [5 + (i * 7) % 40 for i in range(50)]
    enc = [Encoded(input_ids=[1] * n, response_start=1) for n in lengths]
    one, owners1 = plan_chunks(enc, 4)
    assert set(owners1) == {0} and sorted(i for c in one for i in c) == list(range(50))
    chunks, owners = plan_chunks(enc, 4, parts=3)
    assert sorted(i for c in chunks for i in c) == list(range(50))
    assert owners == sorted(owners) and set(owners) == {0, 1, 2}
    assert all(len(c) <= 4 for c in chunks)
    for r in range(3):  # contiguous length ranges that do not overlap
        mine = [lengths[i] for c, o in zip(chunks, owners) if o == r for i in c]
        later = [lengths[i] for c, o in zip(chunks, owners) if o > r for i in c]
        assert not later or max(mine) <= min(later)
    tokens = [sum(lengths[i] for c, o in zip(chunks, owners) if o == r for i in c) for r in range(3)]
    assert max(tokens) - min(tokens) <= 2 * max(lengths)
    assert plan_chunks(enc, 4, parts=3) == (chunks, owners)  # deterministic: resume sees the same


def test_plan_chunks_token_limit():
    """``max_tokens`` ends a chunk before it would exceed the limit (a longer example
    stands alone); without it the chunks are those of ``chunk_size`` alone."""
    from prism_select.data.tokenize import Encoded
    from prism_select.scoring import plan_chunks

    lengths = [5 + (i * 7) % 40 for i in range(50)]
    enc = [Encoded(input_ids=[1] * n, response_start=1) for n in lengths]
    chunks, owners = plan_chunks(enc, 8, parts=2, max_tokens=60)
    assert sorted(i for c in chunks for i in c) == list(range(50))
    for c in chunks:
        assert len(c) <= 8 and (len(c) == 1 or sum(lengths[i] for i in c) <= 60)
    assert any(len(c) == 1 and lengths[c[0]] > 30 for c in chunks)
    assert len(chunks) > len(plan_chunks(enc, 8, parts=2)[0])
    assert plan_chunks(enc, 8, parts=2, max_tokens=60) == (chunks, owners)  # deterministic
    order = sorted(range(50), key=lambda i: (lengths[i], i))
    assert plan_chunks(enc, 8)[0] == [order[k:k + 8] for k in range(0, 50, 8)]


def test_plan_chunks_aligned_to_the_batch_gives_every_rank_count_the_one_rank_batches():
    """With ``align`` = the batch size (dividing the chunk size), every batch holds the same
    examples on 2, 3 or 5 ranks as on one: the padding, hence the half-precision scores, of
    every example are those of the one-rank run. Without it the shares cut batches."""
    from prism_select.data.tokenize import Encoded
    from prism_select.scoring import plan_chunks

    lengths = [5 + (i * 7) % 40 for i in range(50)]
    enc = [Encoded(input_ids=[1] * n, response_start=1) for n in lengths]
    batch = 4

    def batches(plan):
        return sorted(tuple(c[s:s + batch]) for c in plan[0] for s in range(0, len(c), batch))

    one = batches(plan_chunks(enc, 8, align=batch))
    for parts in (2, 3, 5):
        plan = plan_chunks(enc, 8, parts=parts, align=batch)
        assert batches(plan) == one
        assert plan[1] == sorted(plan[1]) and len(set(plan[1])) == parts
    assert any(batches(plan_chunks(enc, 8, parts=p)) != one for p in (2, 3, 5))


def test_plan_chunks_interleaved_deals_the_one_rank_batches_in_turn():
    """``interleave`` (FSDP2's lockstep): every batch is the one-rank run's, the ranks'
    batch counts differ by at most one, and the k-th batches of all ranks are neighbours
    in the length-sorted order (about as long), where contiguous shares put the short
    batches on one rank and the long ones on another."""
    from prism_select.data.tokenize import Encoded
    from prism_select.scoring import plan_chunks

    lengths = [5 + (i * 7) % 40 for i in range(50)]
    enc = [Encoded(input_ids=[1] * n, response_start=1) for n in lengths]
    batch = 4

    def rank_batches(plan, r):
        return [tuple(c[s:s + batch]) for c, o in zip(*plan) if o == r for s in range(0, len(c), batch)]

    one = rank_batches(plan_chunks(enc, 8, align=batch), 0)
    for parts in (2, 3, 5):
        plan = plan_chunks(enc, 8, parts=parts, align=batch, interleave=True)
        per_rank = [rank_batches(plan, r) for r in range(parts)]
        assert sorted(b for bs in per_rank for b in bs) == sorted(one)
        counts = [len(bs) for bs in per_rank]
        assert max(counts) - min(counts) <= 1
        for r, bs in enumerate(per_rank):  # rank r's k-th batch is the one-rank run's batch k*parts + r
            assert bs == [one[k * parts + r] for k in range(len(bs))]
        assert plan_chunks(enc, 8, parts=parts, align=batch, interleave=True) == plan  # deterministic
        contiguous = plan_chunks(enc, 8, parts=parts, align=batch)
        assert max(lengths[i] for i in rank_batches(contiguous, 0)[0]) < min(
            lengths[i] for i in rank_batches(contiguous, parts - 1)[0])
    chunks, owners = plan_chunks(enc, 8, parts=2, max_tokens=60, align=batch, interleave=True)
    assert sorted(i for c in chunks for i in c) == list(range(50))
    assert all(len(c) <= 8 and (len(c) == 1 or sum(lengths[i] for i in c) <= 60) for c in chunks)


def test_one_summary_per_command_under_torchrun(two_ranks):
    """Each `score` of the two-rank launch prints its summary once (rank 0), not once per rank."""
    console = (two_ranks / "console.txt").read_text().splitlines()
    commands = json.loads((two_ranks / "commands.json").read_text())
    assert sum(line.startswith("scored ") for line in console) == len(commands)
    assert sum(line.startswith("next: prism-select select") for line in console) == len(commands)
