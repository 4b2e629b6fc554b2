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

from cli_errors import fails as _fails
from tiny import save_tiny


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


# --------------------------------------------------------------------------- the run folder


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile-files")
    pool, targets = make_example(d / "data", n_pool=8, n_pairs=3)
    return save_tiny(d / "model"), pool, targets


def _score_argv(files, out, *extra, pool=None):
    model, pool0, targets = files
    return ["score", "--model", str(model), "--pool", str(pool or pool0), "--targets", str(targets),
            "--out", str(out), "--device", "cpu", "--dtype", "float32", "--max-length", "128", "--no-progress",
            "--curvature", "identity", "--cache-dir", str(Path(out).parent / "cache"), *extra]


def _scores(out):
    return [json.loads(line) for line in (Path(out) / "scores.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(files, tmp_path_factory):
    out = tmp_path_factory.mktemp("hostile-files-ref") / "ref"
    assert cli.main(_score_argv(files, out)) == 0
    return out


def test_a_partial_that_is_a_link_is_refused_and_overwrite_removes_the_link_itself(files, reference, tmp_path,
                                                                                   capsys):
    out, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("keep")
    (out / ".partial").symlink_to(elsewhere, target_is_directory=True)
    _fails(_score_argv(files, out), capsys, f"{out / '.partial'} is a symbolic link", "--overwrite")
    assert _tree(elsewhere) == {"keep.txt": b"keep"}
    assert cli.main(_score_argv(files, out, "--overwrite")) == 0
    assert _tree(elsewhere) == {"keep.txt": b"keep"} and not (out / ".partial").exists()
    assert _scores(out) == _scores(reference)


def test_a_link_planted_inside_an_unfinished_run_is_refused(files, tmp_path, capsys):
    out, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    elsewhere.mkdir()
    (out / ".partial").mkdir(parents=True)
    (out / ".partial" / "scores").symlink_to(elsewhere, target_is_directory=True)
    _fails(_score_argv(files, out), capsys, f"{out / '.partial' / 'scores'} is a symbolic link")
    assert list(elsewhere.iterdir()) == []


def test_a_second_run_with_the_same_out_is_refused_while_the_first_holds_it(files, reference, tmp_path, capsys,
                                                                            monkeypatch):
    from prism_select import locks
    from prism_select.run import folder, job

    out = tmp_path / "run"
    out.mkdir()
    loaded = []
    monkeypatch.setattr(job, "load_model", lambda *a, **k: loaded.append(1) / 0)
    with locks.held(out / folder.RUN_LOCK):  # another run holds it (a lock is per open file)
        _fails(_score_argv(files, out), capsys, f"{out} is in use by another prism-select run",
               f"process {os.getpid()}")
    assert loaded == [] and list(out.iterdir()) == []  # refused before the model loads, nothing left
    monkeypatch.undo()
    (out / folder.RUN_LOCK).write_text("4194304 on elsewhere\n")  # a dead process's lock file
    assert cli.main(_score_argv(files, out)) == 0
    assert _scores(out) == _scores(reference) and not (out / folder.RUN_LOCK).exists()


def test_a_finished_run_is_reported_before_the_model_loads(files, reference, tmp_path, capsys, monkeypatch):
    import shutil

    from prism_select.run import job

    out = tmp_path / "run"
    shutil.copytree(reference, out)
    monkeypatch.setattr(job, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    _fails(_score_argv(files, out), capsys, "already holds a finished run", "--overwrite")


def test_a_pool_rewritten_while_it_is_scored_stops_the_run(files, tmp_path, capsys, monkeypatch):
    import shutil

    from prism_select.run import job

    pool = tmp_path / "pool.jsonl"
    shutil.copy(files[1], pool)
    real = job._method_fn

    def rewriting(name):
        fn = real(name)

        def run(ctx):
            out = fn(ctx)
            rows = pool.read_text().splitlines()
            pool.write_text("\n".join(rows[::-1]) + "\n")  # another process rewrites the pool meanwhile
            return out
        return run

    monkeypatch.setattr(job, "_method_fn", rewriting)
    out = tmp_path / "run"
    _fails(_score_argv(files, out, pool=pool), capsys, str(pool), "changed while the run read and scored it")
    assert not (out / "scores.jsonl").exists() and not (out / "run.json").exists()
    assert not (out / ".partial").exists()


def test_select_refuses_a_pool_changed_after_the_run(files, reference, tmp_path, capsys):
    import shutil

    pool = tmp_path / "pool.jsonl"
    shutil.copy(files[1], pool)
    out = tmp_path / "run"
    assert cli.main(_score_argv(files, out, pool=pool)) == 0
    rows = pool.read_text().splitlines()
    pool.write_text("\n".join(rows[::-1]) + "\n")
    _fails(["select", "--run", out, "--pool", pool, "--keep", "2", "--out", tmp_path / "kept.jsonl"], capsys,
           "not the pool")
    assert not (tmp_path / "kept.jsonl").exists()


# --------------------------------------------------------------------------- signals, temporary files, names


def test_sigterm_is_handled_as_ctrl_c(files, tmp_path, capsys, monkeypatch):
    """What ``timeout``, Slurm and docker send: the interrupt's line and exit 143, the
    run folder's lock released, and the handler before the command restored after it."""
    import signal

    from prism_select.run import job

    def unhandled(signum, frame):
        raise RuntimeError("SIGTERM reached the handler outside the command")

    out = tmp_path / "run"
    monkeypatch.setattr(job, "load_model", lambda *a, **k: os.kill(os.getpid(), signal.SIGTERM))
    before = signal.signal(signal.SIGTERM, unhandled)
    try:
        assert cli.main([str(a) for a in _score_argv(files, out)]) == 143
        assert signal.getsignal(signal.SIGTERM) is unhandled
    finally:
        signal.signal(signal.SIGTERM, before)
    err = capsys.readouterr().err
    assert "terminated (SIGTERM)" in err and "run the same command again" in err and "Traceback" not in err
    assert not out.exists()  # nothing had started: no --out (and no lock file) left


def test_a_select_killed_mid_write_leaves_no_temporary_file_after_the_next(files, reference, tmp_path):
    import signal

    kept = tmp_path / "sel" / "kept.jsonl"
    argv = ["select", "--run", str(reference), "--pool", str(files[1]), "--keep", "3", "--out", str(kept)]
    pid = os.fork()
    if pid == 0:  # the child is killed (SIGKILL) in the middle of writing --out
        try:
            os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)
            cli.main(argv)
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    left = [p.name for p in kept.parent.iterdir()]
    assert len(left) == 1 and left[0].startswith(".kept.jsonl.") and left[0].endswith(".tmp")  # killed mid-write
    assert cli.main(argv) == 0
    left = sorted(p.name for p in kept.parent.iterdir())  # the subset, its decisions and manifest
    assert left == ["kept.decisions.jsonl", "kept.jsonl", "kept.manifest.json"]
    assert len(kept.read_text().splitlines()) == 3


def test_a_live_writers_temporary_file_is_kept():
    from prism_select import io

    d = Path(os.environ.get("TMPDIR", "/tmp"))
    import tempfile
    with tempfile.TemporaryDirectory(dir=d) as t:
        mine = Path(t) / f".kept.jsonl.{os.getpid()}-{io._HOST}.abcdefgh.tmp"
        mine.write_text("being written")
        old_form = Path(t) / ".kept.jsonl.abcdefgh.tmp"
        old_form.write_text("x")
        _old(old_form, io.STALE_TEMP_S + 60)
        assert io.remove_stale_temps(Path(t) / "kept.jsonl") == [old_form] and mine.exists()


@pytest.mark.parametrize("command", ["score", "select"])
def test_an_out_name_too_long_is_a_named_error(files, reference, tmp_path, command, capsys):
    out = tmp_path / ("r" * 300)
    if command == "score":
        argv = _score_argv(files, out)
    else:
        argv = ["select", "--run", reference, "--pool", files[1], "--keep", "2", "--out", out]
    _fails(argv, capsys, "setting 'out'", "ENAMETOOLONG", "300 characters")


def test_a_cache_dir_of_an_unknown_users_home_is_a_named_error(files, tmp_path, capsys):
    argv = _score_argv(files, tmp_path / "run")
    argv[argv.index("--cache-dir") + 1] = "~nosuchuser-prism/c"
    _fails(argv, capsys, "setting 'cache_dir'", "~nosuchuser-prism", "a user this system does not know")
    _fails(["cache", "list", "--cache-dir", "~nosuchuser-prism/c"], capsys, "setting 'cache_dir'")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("stream", [False, True])
def test_ids_1_and_text_1_are_one_id_refused_as_duplicates(files, tmp_path, stream, capsys):
    pool = tmp_path / "pool.jsonl"
    rows = [json.loads(line) for line in Path(files[1]).read_text().splitlines()][:4]
    for r, rid in zip(rows, [1, "1", 2, 3]):
        r["id"] = rid
    pool.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = _score_argv(files, tmp_path / "run", *(["--stream"] if stream else []), pool=pool)
    _fails(argv, capsys, "duplicate id", "lines 1 and 2", "1 and '1' are one id")


def test_an_entry_being_written_is_not_removed(tmp_path):
    """Its write lock held (as by another process writing it), an entry survives clear,
    prune and eviction; released, it is removed."""
    from prism_select import locks

    d = _real_cache(tmp_path / "cache")
    with locks.held(cache.lock_path(d)):
        assert cache.clear(tmp_path / "cache") == [] and cache.prune(tmp_path / "cache", max_bytes=0) == []
        cache.make_room(tmp_path / "cache", 10, max_bytes=10)
        assert d.exists()
    assert [e.path for e in cache.clear(tmp_path / "cache")] == [d] and not d.exists()
    assert not cache.lock_path(d).exists()


def test_a_second_writer_of_an_entry_waits_for_the_first(tmp_path):
    import threading

    d = tmp_path / "cache" / "curvature" / "k"
    order = []

    def second():
        cache.guarded_write(d, lambda: order.append("second"), "x")

    with cache.writing(d):
        t = threading.Thread(target=second)
        t.start()
        t.join(0.5)
        order.append("first")
    t.join(10)
    assert order == ["first", "second"]


def test_the_python_api_names_a_path_too_long_before_any_work(files, reference, tmp_path):
    """``ps.score``, ``ps.compare`` and ``ps.select`` name a path argument whose name is longer than the file
    system allows, as the CLI does, instead of raising the raw ENAMETOOLONG."""
    import prism_select as ps
    from prism_select.errors import ConfigError
    long = tmp_path / ("r" * 300)
    with pytest.raises(ConfigError, match=r"setting 'out'.*ENAMETOOLONG"):
        ps.select(reference, files[1], long / "kept.jsonl", keep=2)
    with pytest.raises(ConfigError, match=r"setting 'pool'.*ENAMETOOLONG"):
        ps.score(str(files[0]), long / "pool.jsonl", files[2], tmp_path / "run")
    with pytest.raises(ConfigError, match=r"setting 'out'.*ENAMETOOLONG"):
        ps.compare(ps.ModelSettings(model=str(files[0])), files[1], files[2], long, ["random"])
    assert not (tmp_path / "run").exists()
