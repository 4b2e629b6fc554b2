"""Choosing ids from scores and writing the kept records in every format."""

from __future__ import annotations

import json
import math

import pytest

from prism_select.data import iter_records, load_pool
from prism_select.errors import ConfigError, InputError, OutputError
from prism_select.io import sha256_file
from prism_select.selection import choose, describe, parse_amount, read_scores, select, write_subset

from record_files import FORMATS, SUFFIX, write, write_lines

POOL = [{"id": f"ex{i}", "prompt": f"q{i}", "response": f"a{i}", "source": f"s{i % 3}",
         "meta": {"n": i, "tags": ["x", str(i)]}, "weight": i / 4} for i in range(10)]


def scores_for(ids, path):
    """Scores where the first id is best (rank 1)."""
    rows = [{"id": x, "score": float(len(ids) - r), "rank": r + 1} for r, x in enumerate(ids)]
    write_lines(path, rows)
    return rows


def make_run(run, ids, pool, **run_json):
    """A finished run directory over ``pool`` (as score writes it: scores.jsonl and a
    run.json with the pool file's fingerprint), ``ids[0]`` ranked best."""
    run.mkdir(exist_ok=True)
    scores_for(ids, run / "scores.jsonl")
    info = {"status": "complete", "inputs": {"pool": str(pool)},
            "fingerprints": {"pool_file": sha256_file(pool)}, **run_json}
    (run / "run.json").write_text(json.dumps(info))
    return run


# ------------------------------------------------------------------ amounts and choice

@pytest.mark.parametrize("text,expected", [
    ("10", ("count", 10)), (" 3 ", ("count", 3)), (7, ("count", 7)), ("25%", ("fraction", .25)),
    ("100%", ("fraction", 1.0)), ("0.5 %", ("fraction", .005))])
def test_parse_amount(text, expected):
    assert parse_amount(text) == expected


@pytest.mark.parametrize("text", ["0", "-3", "1.5", "abc", "", "0%", "101%", "nan%", "x%",
                                  "1e3", True])
def test_parse_amount_rejects(text):
    with pytest.raises(ConfigError, match="setting 'remove'"):
        parse_amount(text, "remove")


SCORES = [{"id": f"ex{i}", "score": -i, "rank": i + 1} for i in range(10)][::-1]


@pytest.mark.parametrize("keep,remove,expected", [
    ("3", None, {0, 1, 2}), ("25%", None, {0, 1, 2}),  # 2.5 rounds half up to 3
    ("1%", None, {0}),  # at least one is kept
    (None, "2", set(range(2, 10))), (None, "20%", set(range(2, 10))),
    (None, "1%", set(range(10))), ("10", None, set(range(10))),
    (("count", 4), None, {0, 1, 2, 3})])
def test_choose(keep, remove, expected):
    assert choose(SCORES, keep=keep, remove=remove) == {f"ex{i}" for i in expected}


@pytest.mark.parametrize("kw,fragment", [
    ({}, "exactly one"), ({"keep": "1", "remove": "1"}, "exactly one"),
    ({"keep": "11"}, "only 10"), ({"remove": "10"}, "leaves no"),
    ({"remove": "100%"}, "leaves no")])
def test_choose_rejects(kw, fragment):
    with pytest.raises(ConfigError, match=fragment):
        choose(SCORES, **kw)


def test_read_scores(tmp_path):
    rows = scores_for(["b", 3, "a"], tmp_path / "scores.jsonl")
    (tmp_path / "s2.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[::-1]))
    assert read_scores(tmp_path / "s2.jsonl") == rows  # sorted by rank


@pytest.mark.parametrize("bad,field", [
    ({"score": 1.0, "rank": 2}, "id"), ({"id": 1.5, "score": 1.0, "rank": 2}, "id"),
    ({"id": "x", "rank": 2}, "score"), ({"id": "x", "score": math.nan, "rank": 2}, "score"),
    ({"id": "x", "score": 1.0, "rank": 0}, "rank"),
    ({"id": "x", "score": 1.0, "rank": 1.0}, "rank"),
    ({"id": "x", "score": 1.0, "rank": 1}, "rank"), ({"id": "a", "score": 1.0, "rank": 2}, "id")])
def test_read_scores_rejects(tmp_path, bad, field):
    p = write_lines(tmp_path / "scores.jsonl", [{"id": "a", "score": 2.0, "rank": 1}, bad])
    with pytest.raises(InputError) as e:
        read_scores(p)
    assert (e.value.row, e.value.field) == (1, field)


def test_read_scores_missing(tmp_path):
    with pytest.raises(InputError, match="not found"):
        read_scores(tmp_path / "scores.jsonl")


# ------------------------------------------------------------------ writing subsets

def records(path):
    return [r for _, r in iter_records(path)]


def as_written(fmt, recs):
    """What a record looks like after a round trip through ``fmt``'s own writer."""
    if fmt != "csv":
        return recs
    return [{k: v if isinstance(v, str) else json.dumps(v) for k, v in r.items()} for r in recs]


@pytest.mark.parametrize("fmt", FORMATS)
def test_write_subset_same_format_keeps_every_field(tmp_path, fmt):
    pool = write(tmp_path / "pool", fmt, POOL)
    out = tmp_path / ("out" + SUFFIX[fmt])
    kept = {"ex7", "ex2", "ex5"}
    assert write_subset(pool, kept, out) == 3
    assert records(out) == as_written(fmt, [POOL[2], POOL[5], POOL[7]])  # original order
    if fmt == "parquet":
        import pyarrow.parquet as pq

        assert pq.read_schema(out) == pq.read_schema(pool)
    if fmt == "arrow":
        import datasets

        assert datasets.load_from_disk(str(out)).features == datasets.load_from_disk(
            str(pool)).features
    if fmt == "csv":
        assert out.read_text().splitlines()[0] == pool.read_text().splitlines()[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([pool.name, out.name])


@pytest.mark.parametrize("src", FORMATS)
@pytest.mark.parametrize("dst", FORMATS)
def test_write_subset_cross_format(tmp_path, src, dst):
    pool = write(tmp_path / "pool", src, POOL)
    out = tmp_path / ("out" + SUFFIX[dst])
    assert write_subset(pool, {"ex1", "ex9"}, out, out_format=dst if dst == "arrow" else None) == 2
    expected = as_written(src, [POOL[1], POOL[9]])
    if dst == "csv" and src != "csv":
        expected = as_written("csv", expected)
    assert records(out) == expected
    assert [x.id for x in load_pool(out).items] == ["ex1", "ex9"]


def test_write_subset_default_row_ids_and_skips_invalid(tmp_path):
    recs = [{"prompt": "q0", "response": "a0"}, {"prompt": "q1"},  # row 1 is invalid
            {"prompt": "q2", "response": "a2", "x": 1}, {"id": 1, "prompt": "q", "response": "a"}]
    pool = write_lines(tmp_path / "p.jsonl", recs)
    pool.write_text(pool.read_text() + "{broken\n")
    assert [x.id for x in load_pool(pool, skip_invalid=True).items] == [0, 2, 1]
    assert write_subset(pool, {2, 1}, tmp_path / "o.jsonl") == 2
    assert records(tmp_path / "o.jsonl") == [recs[2], recs[3]]


def test_write_subset_unknown_ids_leaves_no_output(tmp_path):
    for fmt in FORMATS:
        pool = write(tmp_path / f"pool_{fmt}", fmt, POOL)
        out = tmp_path / f"out_{fmt}{SUFFIX[fmt]}"
        with pytest.raises(InputError, match="another pool") as e:
            write_subset(pool, {"ex1", "nope"}, out)
        assert "'nope'" in str(e.value)
        assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".", "out"))]


def test_write_subset_refuses_pool_as_output(tmp_path):
    pool = write(tmp_path / "pool", "jsonl", POOL)
    with pytest.raises(OutputError, match="pool itself"):
        write_subset(pool, {"ex1"}, pool)
    with pytest.raises(ConfigError, match="format"):
        write_subset(pool, {"ex1"}, tmp_path / "o", out_format="xml")


# ------------------------------------------------------------------ select

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("keep,remove,kept", [
    ("4", None, [9, 8, 7, 6]), ("30%", None, [9, 8, 7]),
    (None, "4", [5, 4, 3, 2, 1, 0]), (None, "30%", [6, 5, 4, 3, 2, 1, 0])])
def test_select(tmp_path, fmt, keep, remove, kept):
    pool = write(tmp_path / "pool", fmt, POOL)
    run = make_run(tmp_path / "run", [f"ex{i}" for i in range(9, -1, -1)], pool)  # ex9 best
    out = tmp_path / ("subset" + SUFFIX[fmt])
    summary = select(run, pool, out, keep=keep, remove=remove)
    assert summary["kept"] == len(kept) and summary["removed"] == 10 - len(kept)
    assert summary["mode"] == ("keep" if keep else "remove") and summary["scored"] == 10
    assert records(out) == as_written(fmt, [POOL[i] for i in sorted(kept)])


def test_select_errors_leave_no_output(tmp_path):
    pool = write(tmp_path / "pool", "jsonl", POOL)
    (tmp_path / "run").mkdir()
    with pytest.raises(InputError, match="run.json is missing"):
        select(tmp_path / "run", pool, tmp_path / "o.jsonl", keep="1")
    (tmp_path / "run" / "run.json").write_text(json.dumps({"fingerprints": {"pool_file": sha256_file(pool)}}))
    with pytest.raises(InputError, match="scores file not found"):
        select(tmp_path / "run", pool, tmp_path / "o.jsonl", keep="1")
    make_run(tmp_path / "run", [f"ex{i}" for i in range(10)], pool)
    with pytest.raises(ConfigError):
        select(tmp_path / "run", pool, tmp_path / "o.jsonl", keep="11")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pool.jsonl", "run"]


def test_select_refuses_another_pool(tmp_path):
    pool = write(tmp_path / "pool", "jsonl", POOL)
    run = make_run(tmp_path / "run", [f"ex{i}" for i in range(10)], pool)
    edited = write(tmp_path / "edited", "jsonl", POOL[:9] + [{**POOL[9], "response": "changed"}])
    with pytest.raises(InputError) as e:
        select(run, edited, tmp_path / "o.jsonl", keep="2")
    msg = str(e.value)
    assert "edited.jsonl" in msg and "file bytes differ" in msg and str(pool) in msg
    assert "--allow-other-pool" in msg
    other = write(tmp_path / "other", "jsonl", POOL[:8])  # ex8, ex9 were scored but are gone
    with pytest.raises(InputError, match=r"2 scored ids are not in it \(e.g. 'ex8', 'ex9'\)") as e:
        select(run, other, tmp_path / "o.jsonl", keep="2", allow_other_pool=True)
    assert "--allow-other-pool" not in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["edited.jsonl", "other.jsonl", "pool.jsonl", "run"]


def test_select_allow_other_pool_lists_unscored(tmp_path):
    pool = write(tmp_path / "pool", "jsonl", POOL)
    run = make_run(tmp_path / "run", [f"ex{i}" for i in range(9, -1, -1)], pool)
    extra = [{"id": "new1", "prompt": "q", "response": "a"}, {"id": "new2", "prompt": "q", "response": "b"}]
    bigger = write(tmp_path / "bigger", "jsonl", extra[:1] + POOL + extra[1:])
    with pytest.raises(InputError, match=r"2 of its ids were not scored \(e.g. 'new1', 'new2'\)"):
        select(run, bigger, tmp_path / "o.jsonl", keep="3")
    summary = select(run, bigger, tmp_path / "o.jsonl", keep="3", allow_other_pool=True)
    assert summary["unscored"] == ["new1", "new2"] and summary["kept"] == 3
    assert [r["id"] for r in records(tmp_path / "o.jsonl")] == ["ex7", "ex8", "ex9"]
    assert "2 records of this pool were not scored and are left out: 'new1', 'new2'" in describe(summary)


def test_select_remove_from_a_pool_with_unscored_records(tmp_path):
    """A run that scored 4 of the pool's 20 records: `--remove 1` is refused (it would
    have dropped the 16 unscored records silently); with --allow-other-pool the summary
    says how many were left out."""
    big = [{"id": f"r{i}", "prompt": f"q{i}", "response": f"a{i}"} for i in range(20)]
    scored = write(tmp_path / "scored", "jsonl", big[:4])
    pool = write(tmp_path / "pool", "jsonl", big)
    run = make_run(tmp_path / "run", ["r0", "r1", "r2", "r3"], scored)
    with pytest.raises(InputError, match=r"16 of its ids were not scored"):
        select(run, pool, tmp_path / "o.jsonl", remove="1")
    assert not (tmp_path / "o.jsonl").exists()
    summary = select(run, pool, tmp_path / "o.jsonl", remove="1", allow_other_pool=True)
    assert summary["kept"] == 3 and len(summary["unscored"]) == 16
    assert "wrote 3 of 4 scored records" in describe(summary) and "16 records of this pool were not scored" in \
        describe(summary)


def test_select_refuses_another_id_less_pool(tmp_path):
    """Without ids a pool's ids are its row numbers, so any file of as many rows has the
    same ids: the pool file's bytes tell them apart."""
    plain = [{"prompt": f"q{i}", "response": f"a{i}"} for i in range(5)]
    pool = write(tmp_path / "pool", "jsonl", plain)
    other = write(tmp_path / "other", "jsonl", [{"prompt": f"other {i}", "response": "x"} for i in range(5)])
    run = make_run(tmp_path / "run", [4, 3, 2, 1, 0], pool)
    with pytest.raises(InputError, match="file bytes differ"):
        select(run, other, tmp_path / "o.jsonl", keep="2")
    assert select(run, pool, tmp_path / "o.jsonl", keep="2")["kept"] == 2
    assert records(tmp_path / "o.jsonl") == plain[3:]


def test_select_run_without_file_fingerprint_checks_ids(tmp_path):
    """Runs written before run.json had fingerprints.pool_file: the ids are compared,
    and records the run skipped as invalid do not count as unscored."""
    pool = write(tmp_path / "pool", "jsonl", POOL)
    run = make_run(tmp_path / "run", [f"ex{i}" for i in range(1, 10)], pool,
                   fingerprints={}, invalid_records=[{"path": str(pool), "row": 0}])
    assert select(run, pool, tmp_path / "a.jsonl", keep="1")["kept"] == 1
    make_run(run, [f"ex{i}" for i in range(2, 10)], pool,
             fingerprints={}, invalid_records=[{"path": str(pool), "row": 0}])
    with pytest.raises(InputError, match=r"1 of its ids were not scored \(e.g. 'ex1'\)"):
        select(run, pool, tmp_path / "b.jsonl", keep="1")


def test_select_refuses_existing_out(tmp_path):
    pool = write(tmp_path / "pool", "jsonl", POOL)
    run = make_run(tmp_path / "run", [f"ex{i}" for i in range(10)], pool)
    out = tmp_path / "o.jsonl"
    out.write_text("keep me\n")
    with pytest.raises(OutputError, match="already exists; pass --overwrite"):
        select(run, pool, out, keep="2")
    assert out.read_text() == "keep me\n"
    assert select(run, pool, out, keep="2", overwrite=True)["kept"] == 2
    assert [r["id"] for r in records(out)] == ["ex0", "ex1"]


def test_select_cli_summary_is_two_lines(tmp_path, capsys):
    from prism_select.cli import main

    pool = write(tmp_path / "pool", "jsonl", POOL)
    run = make_run(tmp_path / "run", [f"ex{i}" for i in range(10)], pool)
    out = tmp_path / "o.jsonl"
    assert main(["select", "--run", str(run), "--pool", str(pool), "--remove", "20%", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    decisions, manifest = tmp_path / "o.decisions.jsonl", tmp_path / "o.manifest.json"
    assert text == (f"wrote 8 of 10 scored records to {out} (removed the top 20% of {pool})\n"
                    f"keep not_removed: 8, drop removed: 2; decisions in {decisions}, manifest in {manifest}\n")
    assert main(["select", "--run", str(run), "--pool", str(pool), "--keep", "1", "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_write_subset_lone_surrogate_roundtrips(tmp_path, suffix):
    rec = {"prompt": "q", "response": "a", "note": "\ud800 é"}  # legal JSON, not UTF-8
    pool = write_lines(tmp_path / "p.jsonl", [rec])
    assert write_subset(pool, {0}, tmp_path / ("o" + suffix)) == 1
    assert records(tmp_path / ("o" + suffix)) == [rec]
