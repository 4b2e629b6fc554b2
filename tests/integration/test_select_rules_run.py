"""`select`'s rules on a real run: a tiny model scores a pool with a planted duplicate and a
planted copy of a target pair, then `prism-select select` drops both and says why."""

import json

from prism_select.cli import main
from prism_select.curvature import CurvatureSettings
from prism_select.examples import make_example
from prism_select.io import sha256_file
from prism_select.model import ModelSettings
from prism_select.run import score_pool
from prism_select.settings import ScoreSettings

from tiny import save_tiny


def test_select_rules_on_a_scored_run(tmp_path, capsys):
    pool, targets = make_example(tmp_path / "data", n_pool=10, n_pairs=3)
    rows = [json.loads(line) for line in pool.read_text().splitlines()]
    t0 = json.loads(targets.read_text().splitlines()[0])
    rows.append({**rows[0], "id": "dup"})
    rows.append({"id": "leak", "prompt": t0["prompt"], "response": t0["chosen"], "harmful": False})
    pool.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ms = ModelSettings(model=str(save_tiny(tmp_path / "model")), dtype="float32", device="cpu",
                       cache_dir=str(tmp_path / "cache"))
    run = tmp_path / "run"
    score_pool(ms, pool, targets, run, ScoreSettings(max_length=128, batch_size=4, progress=False),
               CurvatureSettings(kind="ekfac"))
    out = tmp_path / "selected.jsonl"
    assert main(["select", "--run", str(run), "--pool", str(pool), "--keep", "100%", "--dedup",
                 "--exclude-overlap", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "drop overlap: 1" in printed and "drop duplicate: 1" in printed
    dec = {d["id"]: d for d in map(json.loads, (tmp_path / "selected.decisions.jsonl").read_text().splitlines())}
    assert len(dec) == 12 and (dec["leak"]["reason"], dec["leak"]["of"]) == ("overlap", f"target:{t0['id']}")
    first, second = sorted(["ex0000", "dup"], key=lambda i: dec[i]["rank"])
    assert (dec[second]["reason"], dec[second]["of"]) == ("duplicate", first) and dec[first]["decision"] == "keep"
    kept = {json.loads(line)["id"] for line in out.read_text().splitlines()}
    assert kept == {i for i, d in dec.items() if d["decision"] == "keep"} and len(kept) == 10
    manifest = json.loads((tmp_path / "selected.manifest.json").read_text())
    assert manifest["inputs"]["targets"]["sha256"] == sha256_file(targets)
    assert manifest["inputs"]["pool"]["sha256"] == sha256_file(pool)


def test_two_target_sets_scored_in_one_pass_select_each_its_own_top(tmp_path):
    """``score`` with two target files writes per-task scores; ``select --per-task`` keeps
    each task's share of the budget from its own ranking, as the decisions file says."""
    pool, targets = make_example(tmp_path / "data", n_pool=12, n_pairs=4)
    pairs = targets.read_text().splitlines()
    a, b = tmp_path / "data" / "alpha.jsonl", tmp_path / "data" / "beta.jsonl"
    a.write_text("\n".join(pairs[:2]) + "\n")
    b.write_text("\n".join(pairs[2:]) + "\n")
    model = str(save_tiny(tmp_path / "model"))
    run = tmp_path / "run"
    assert main(["score", "--model", model, "--pool", str(pool), "--targets", str(a), str(b), "--out", str(run),
                 "--cache-dir", str(tmp_path / "cache"), "--max-length", "128", "--batch-size", "4",
                 "--no-progress", "--device", "cpu"]) == 0
    rows = [json.loads(line) for line in (run / "scores.jsonl").read_text().splitlines()]
    assert all(set(r["scores"]) == {"alpha", "beta"} for r in rows)
    out = tmp_path / "selected.jsonl"
    assert main(["select", "--run", str(run), "--pool", str(pool), "--keep", "4", "--per-task",
                 "--out", str(out)]) == 0
    kept = {json.loads(line)["id"] for line in out.read_text().splitlines()}
    top = {task: sorted(rows, key=lambda r: -r["scores"][task]) for task in ("alpha", "beta")}
    # each task's best record is kept, whatever the other task thinks of it
    assert top["alpha"][0]["id"] in kept and top["beta"][0]["id"] in kept and len(kept) == 4
    dec = [json.loads(line) for line in (tmp_path / "selected.decisions.jsonl").read_text().splitlines()]
    assert {d["id"] for d in dec if d["decision"] == "keep"} == kept
