"""PRISM_SELECT_PROFILE: a loop's steps pass through unchanged, and a few of them are
profiled into a table per loop."""

import torch

from prism_select.runtime import profiling


def _loop(n):
    for i in range(n):
        torch.ones(8, 8) @ torch.ones(8, 8)
        yield i


def test_off_records_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv(profiling.ENV, raising=False)
    assert list(profiling.steps("scoring", _loop(5))) == list(range(5))


def test_window_of_steps_is_written_per_loop(tmp_path, monkeypatch):
    monkeypatch.setenv(profiling.ENV, str(tmp_path / "prof"))
    monkeypatch.setenv(profiling.ENV + "_STEPS", "1,2")
    assert list(profiling.steps("curvature factors (group 1/2)", _loop(6))) == list(range(6))
    assert list(profiling.steps("curvature factors (group 1/2)", _loop(2))) == [0, 1]  # ends inside the window
    first = (tmp_path / "prof" / "curvature-factors-group-1-2-rank0-1.txt").read_text()
    second = (tmp_path / "prof" / "curvature-factors-group-1-2-rank0-2.txt").read_text()
    assert first.startswith("curvature factors (group 1/2): 2 steps recorded") and "aten::mm" in first
    assert second.startswith("curvature factors (group 1/2): 1 steps recorded")
    assert list(profiling.steps("scoring", _loop(1))) == [0]  # never reaches its window: no file
    assert not list((tmp_path / "prof").glob("scoring-*"))
