"""Faults that lose nothing: out of GPU memory, out of host memory, a full disk while a
score chunk is written, and a cache write that fails. Each ends the run with a named
error (:class:`prism_select.errors.OutOfResourceError`) that says what ran out, what is
kept and what to change; the finished work (score chunks, the fitted curvature) stays,
and the same command resumes to the scores of an uninterrupted run. A killed process
(SIGKILL) is covered by tests/integration/test_resume.py."""

import errno
import json
from pathlib import Path

import pytest
import torch

from prism_select import scoring
from prism_select.cli import main
from prism_select.curvature import CurvatureSettings
from prism_select.errors import OutOfResourceError
from prism_select.examples import make_example
from prism_select.engine import ExactScorer
from prism_select.model import ModelSettings
from prism_select.run import score_pool
from prism_select.settings import ScoreSettings

from tiny import save_tiny


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("faults")
    pool, targets = make_example(d / "data", n_pool=16, n_pairs=3)
    return save_tiny(d / "model"), pool, targets


@pytest.fixture(scope="module")
def reference(files, tmp_path_factory):
    """The uninterrupted run's scores."""
    d = tmp_path_factory.mktemp("faults-ref")
    _run(files, d / "ref", d / "cache")
    return _scores(d / "ref")


def _run(files, out, cache):
    model, pool, targets = files
    ms = ModelSettings(model=str(model), dtype="float32", device="cpu", cache_dir=str(cache))
    s = ScoreSettings(max_length=128, batch_size=4, chunk_size=4, progress=False)
    # the faults are placed in the pool's scoring, which the heuristic damping reaches directly
    return score_pool(ms, pool, targets, out, s, CurvatureSettings(kind="ekfac", damping_rule="heuristic"))


def _scores(out):
    return [json.loads(line) for line in (Path(out) / "scores.jsonl").read_text().splitlines()]


def _gpu_oom():  # the caching allocator's message under a per-process cap, other processes listed
    return torch.cuda.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.80 GiB of which 70.10 "
        "GiB is free. Process 896 has 7.14 GiB memory in use. Process 928 has 5.79 GiB memory in use. Including "
        "non-PyTorch memory, this process has 16.40 GiB memory in use. Of the allocated memory 15.10 GiB is "
        "allocated by PyTorch, with 16.00 GiB allowed; and 300.00 MiB is reserved by PyTorch but unallocated.")


class _SafetensorError(Exception):  # the shape of safetensors' own error for a full disk
    pass


_SafetensorError.__name__ = "SafetensorError"

FAULTS = {  # where the fault strikes, what it raises, what the message must name
    "gpu memory": ("score", _gpu_oom, "out of GPU memory", "--batch-size"),
    "host memory": ("score", lambda: MemoryError(), "out of host memory", "--batch-size"),
    "disk, OSError": ("write", lambda: OSError(errno.ENOSPC, "No space left on device"), "out of disk",
                      "free disk space"),
    "disk, safetensors": ("write", lambda: _SafetensorError(
        'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'),
        "out of disk", "free disk space"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_fault_while_scoring_keeps_the_work_and_the_same_command_resumes(files, reference, tmp_path, monkeypatch,
                                                                       fault):
    where, make, named, fix = FAULTS[fault]
    out, cache = tmp_path / "out", tmp_path / "cache"
    calls = []
    if where == "score":  # the third batch runs out of memory (chunks of one batch)
        real_score = ExactScorer.score

        def score(self, b):
            calls.append(1)
            if len(calls) == 3:
                raise make()
            return real_score(self, b)
        monkeypatch.setattr(ExactScorer, "score", score)
    else:  # the disk fills up while the third chunk is written
        real_save = scoring._save_chunk

        def save(partial_dir, k, chunk, scores):
            calls.append(1)
            if len(calls) == 3:
                raise make()
            real_save(partial_dir, k, chunk, scores)
        monkeypatch.setattr(scoring, "_save_chunk", save)
    with pytest.raises(OutOfResourceError) as info:
        _run(files, out, cache)
    msg = str(info.value)
    assert named in msg and fix in msg and "run the same command again" in msg
    assert "(after the stage 'fit' had finished)" in msg  # the scoring comes after it
    if fault == "gpu memory":  # what it tried, this process's use and its cap; not the other processes
        assert ("CUDA out of memory. Tried to allocate 2.00 GiB; this process had 16.40 GiB in use; "
                "16.00 GiB allowed (after") in msg and "Process 896" not in msg
    assert "2 finished score chunk(s)" in msg and str(out / ".partial") in msg
    assert "preconditioned direction" in msg and "fitted curvature in" in msg
    assert len(list((out / ".partial").rglob("chunk_*.safetensors"))) == 2
    assert not (out / "scores.jsonl").exists()
    monkeypatch.undo()
    again = _run(files, out, cache)  # the same command
    assert again["curvature"]["resumed"] is True  # from the kept direction: no second fit
    assert _scores(out) == reference


def test_out_of_memory_in_the_fit_is_named_and_leaves_nothing_that_blocks(files, tmp_path, monkeypatch, capsys):
    """Out of memory before the first chunk: the CLI names it (exit 2, no traceback), says
    that nothing had finished, and the same command then runs."""
    model, pool, targets = files
    from prism_select.curvature import eigh, spill

    def oom(*a, **k):
        raise _gpu_oom()
    for mod in (spill, eigh):  # the spilled groups' decompositions and the others'
        monkeypatch.setattr(mod, "_eigh", oom)
    cmd = ["score", "--model", str(model), "--pool", str(pool), "--targets", str(targets), "--out",
           str(tmp_path / "run"), "--cache-dir", str(tmp_path / "cache"), "--device", "cpu", "--dtype", "float32",
           "--no-progress", "--max-length", "128", "--damping-rule", "heuristic"]  # a fit on 16 records
    assert main(cmd) == 2
    err = capsys.readouterr().err
    assert "out of GPU memory" in err and "nothing had finished yet" in err and "Traceback" not in err
    assert not (tmp_path / "run" / ".partial").exists()
    monkeypatch.undo()
    assert main(cmd) == 0


def test_a_failing_cache_write_keeps_the_run_going(files, reference, tmp_path, monkeypatch, caplog):
    """The fitted curvature cannot be saved (disk full): a warning, the run finishes with
    the curvature from memory, nothing half-written is left in the cache, and the next
    run fits again."""
    from prism_select.curvature.base import Curvature

    def full(self, directory, meta):
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / ".factors.safetensors.tmp").write_bytes(b"half")
        raise _SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")
    monkeypatch.setattr(Curvature, "save", full)
    a = _run(files, tmp_path / "a", tmp_path / "cache")
    assert a["curvature"]["path"] is None and "could not save the fitted curvature" in caplog.text
    assert not any((tmp_path / "cache" / "curvature").glob("*"))
    monkeypatch.undo()
    assert _scores(tmp_path / "a") == reference
