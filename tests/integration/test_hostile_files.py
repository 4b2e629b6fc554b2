"""A hostile or careless user's file system: folders that are no cache, links planted in
the cache and the run folder, two runs at once, a pool rewritten while it is scored,
signals, stale temporary files and names too long. Each ends in a named error with
nothing deleted and nothing written outside the run folder, or in the right result. Runs
the CLI in-process on a tiny random-init model (no downloads)."""

import json
import os
import time
from pathlib import Path

import pytest

from prism_select import cache, cli
from prism_select.examples import make_example

from tiny import save_tiny


def _fails(argv, capsys, *needles) -> str:
    """``prism-select argv`` exits 2 with a named error that holds every ``needle``."""
    assert cli.main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("prism-select: error: "), err
    for needle in needles:
        assert needle in err, err
    return err


def _old(path, age_s=7200):
    t = time.time() - age_s
    os.utime(path, (t, t))


def _tree(root) -> dict:
    """Every file under ``root`` (links not followed) and its bytes."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            p = Path(dirpath) / n
            out[str(p.relative_to(root))] = p.read_bytes() if not p.is_symlink() else os.readlink(p)
    return out


def _home(d: Path) -> Path:
    """A folder of a user's own files two levels down, untouched for hours."""
    for rel in ("projects/thesis/ch1.tex", "photos/2024/a.jpg", "models/mine/weights.bin", "curvature/x/notes.txt"):
        f = d / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(rel)
        _old(f.parent)
    return d


# --------------------------------------------------------------------------- the cache commands


@pytest.mark.parametrize("action", [["clear"], ["prune"], ["prune", "--max-gb", "0"], ["list"]])
def test_cache_commands_refuse_a_folder_that_is_not_a_cache(tmp_path, action, capsys):
    home = _home(tmp_path / "home")
    before = _tree(home)
    _fails(["cache", *action, "--cache-dir", home], capsys, f"{home} is not a prism-select cache",
           cache.ROOT_MARKER)
    assert _tree(home) == before


def test_eviction_during_a_run_removes_only_the_caches_own_entries(tmp_path):
    """``score --cache-dir DIR --cache-max-gb`` evicts with make_room: in a folder of the
    user's files it removes nothing of theirs, only the entries the cache made."""
    home = _home(tmp_path / "home")
    before = _tree(home)
    mine = cache.claim(home / "curvature" / "abc")
    (mine / "curvature.json").write_text("{}")
    (mine / "factors.safetensors").write_bytes(b"x" * 4000)
    _old(mine / "curvature.json")
    assert cache.make_room(home, 1000, max_bytes=2000)
    assert not mine.exists() and _tree(home) == {**before, cache.ROOT_MARKER: (home / cache.ROOT_MARKER).read_bytes()}
    assert cache.prune(home, max_bytes=0) == [] and cache.clear(home) == []
    assert _tree(home) == {**before, cache.ROOT_MARKER: (home / cache.ROOT_MARKER).read_bytes()}


def _real_cache(root: Path) -> Path:
    d = cache.claim(root / "curvature" / "k1")
    (d / "factors.safetensors").write_bytes(b"f" * 100)
    (d / "curvature.json").write_text("{}")
    return d


def test_a_folder_without_the_entry_marker_inside_a_cache_is_listed_and_left_alone(tmp_path, capsys):
    root = tmp_path / "cache"
    ours = _real_cache(root)
    foreign = root / "models" / "my-own-model"
    foreign.mkdir(parents=True)
    (foreign / "weights.bin").write_text("keep")
    legacy = root / "curvature" / "0123abcd"  # written before entry markers: its content marker only
    legacy.mkdir()
    (legacy / "curvature.json").write_text("{}")
    beside = root / "notes"
    beside.mkdir()
    (beside / "todo.txt").write_text("keep")
    for d in (foreign, legacy, beside):
        _old(d)
    assert cli.main(["cache", "list", "--cache-dir", str(root)]) == 0
    out = capsys.readouterr().out
    assert f"(not prism-select's)  {foreign}" in out and f"(unmarked entry)     {legacy}" in out
    assert f"(not prism-select's)  {beside}" in out and "1 entries" in out and "rm -r PATH" in out
    assert cli.main(["cache", "prune", "--cache-dir", str(root)]) == 0
    assert cli.main(["cache", "clear", "--cache-dir", str(root)]) == 0
    out = capsys.readouterr().out
    assert "removed 1 entries" in out and "3 folders left alone" in out
    assert not ours.exists()
    assert (foreign / "weights.bin").read_text() == "keep" and (legacy / "curvature.json").is_file()
    assert (beside / "todo.txt").read_text() == "keep"


def test_a_cache_written_before_markers_is_listed_and_nothing_in_it_removed(tmp_path, capsys):
    root = tmp_path / "cache"
    for kind, name in (("curvature", "a1"), ("models", "b2")):
        d = root / kind / name
        d.mkdir(parents=True)
        (d / cache.MARKERS[kind]).write_text("{}")
        _old(d)
    before = _tree(root)
    assert cli.main(["cache", "list", "--cache-dir", str(root)]) == 0
    out = capsys.readouterr().out
    assert out.count("(unmarked entry)") == 2 and "0 entries" in out
    assert cli.main(["cache", "clear", "--cache-dir", str(root)]) == 0
    assert cli.main(["cache", "prune", "--max-gb", "0", "--cache-dir", str(root)]) == 0
    assert _tree(root) == before


# --------------------------------------------------------------------------- links in the cache


@pytest.mark.parametrize("linked", ["kind", "entry"])
def test_links_in_the_cache_are_never_listed_as_entries_or_removed_through(tmp_path, linked, capsys):
    root = tmp_path / "cache"
    _real_cache(root)
    elsewhere = tmp_path / "elsewhere"
    # what the link leads to looks like the cache's own entries (markers and all)
    target = cache.claim(elsewhere / "curvature" / "zz")
    (target / "curvature.json").write_text("{}")
    (target / "data").write_text("keep")
    plain = elsewhere / "curvature" / "plain"
    plain.mkdir()
    (plain / "f").write_text("keep")
    _old(plain)
    if linked == "kind":
        (root / "models").symlink_to(elsewhere / "curvature", target_is_directory=True)
        link = root / "models"
    else:
        link = root / "curvature" / "zz"
        link.symlink_to(target, target_is_directory=True)
    before = _tree(elsewhere)
    assert cli.main(["cache", "list", "--cache-dir", str(root)]) == 0
    out = capsys.readouterr().out
    assert f"(symbolic link)      {link}" in out and "1 entries" in out and str(target) not in out
    assert [e.path.name for e in cache.entries(root)] == ["k1"]
    assert cli.main(["cache", "prune", "--cache-dir", str(root)]) == 0
    assert cli.main(["cache", "clear", "--cache-dir", str(root)]) == 0
    assert cache.make_room(root, 10, max_bytes=10)
    assert _tree(elsewhere) == before and link.is_symlink()
    assert cache.remove(link) is False and cache.remove(root / "models" / "zz") is False
    assert _tree(elsewhere) == before
