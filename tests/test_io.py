"""Atomic output helpers and fingerprints."""

from __future__ import annotations

import errno
import hashlib
import json
import os

import pytest

from prism_select import io
from prism_select.errors import InputError, OutputError


def listing(d):
    return sorted(p.name for p in d.iterdir())


def test_atomic_writes(tmp_path):
    io.atomic_write_text(tmp_path / "a.txt", "héllo\n")
    io.atomic_write_bytes(tmp_path / "b.bin", b"\x00\xff")
    io.atomic_write_json(tmp_path / "sub" / "c.json", {"z": 1, "a": [1, "é"]})
    assert io.atomic_write_jsonl(tmp_path / "d.jsonl", ({"i": i} for i in range(3))) == 3
    assert (tmp_path / "a.txt").read_text(encoding="utf-8") == "héllo\n"
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\xff"
    text = (tmp_path / "sub" / "c.json").read_text(encoding="utf-8")
    assert text == json.dumps({"z": 1, "a": [1, "é"]}, indent=2, ensure_ascii=False) + "\n"
    assert (tmp_path / "d.jsonl").read_text().splitlines() == ['{"i": 0}', '{"i": 1}', '{"i": 2}']
    assert listing(tmp_path) == ["a.txt", "b.bin", "d.jsonl", "sub"]


def test_output_mode_follows_umask(tmp_path):
    umask = os.umask(0)
    os.umask(umask)
    io.atomic_write_text(tmp_path / "a.txt", "x")
    assert (tmp_path / "a.txt").stat().st_mode & 0o777 == 0o666 & ~umask


def test_replaces_existing(tmp_path):
    p = tmp_path / "a.json"
    p.write_text("old")
    io.atomic_write_json(p, [1])
    assert p.read_text() == "[\n  1\n]\n"


def test_unserialisable_leaves_nothing(tmp_path):
    p = tmp_path / "a.json"
    p.write_text("old")
    with pytest.raises(OutputError, match="JSON-serialisable"):
        io.atomic_write_json(p, {"a": object()})
    with pytest.raises(OutputError, match="a.jsonl"):
        io.atomic_write_jsonl(tmp_path / "a.jsonl", [{"a": 1}, {"b": object()}])
    assert p.read_text() == "old" and listing(tmp_path) == ["a.json"]


def test_failing_iterable_leaves_nothing(tmp_path):
    def rows():
        yield {"a": 1}
        raise InputError("bad record", row=1)

    with pytest.raises(InputError, match="bad record"):
        io.atomic_write_jsonl(tmp_path / "a.jsonl", rows())
    assert listing(tmp_path) == []


def test_unwritable_path(tmp_path):
    (tmp_path / "afile").write_text("")
    target = tmp_path / "afile" / "x.json"
    for write in (lambda: io.atomic_write_json(target, {}),
                  lambda: io.atomic_write_bytes(target, b""),
                  lambda: io.check_writable_dir(tmp_path / "afile" / "dir"),
                  lambda: io.check_writable_dir(tmp_path / "afile")):
        with pytest.raises(OutputError, match="afile"):
            write()
    assert listing(tmp_path) == ["afile"]


def test_disk_full_on_replace(tmp_path, monkeypatch):
    def full(*a):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(io.os, "replace", full)
    with pytest.raises(OutputError, match="No space left") as e:
        io.atomic_write_text(tmp_path / "a.txt", "x")
    assert str(tmp_path / "a.txt") in str(e.value)
    assert listing(tmp_path) == []


def test_check_writable_dir(tmp_path):
    d = io.check_writable_dir(tmp_path / "a" / "b")
    assert d.is_dir() and listing(d) == []


def test_atomic_write_dir(tmp_path):
    out = tmp_path / "ds"
    io.atomic_write_dir(out, lambda d: (d / "state.json").write_text("1"))
    io.atomic_write_dir(out, lambda d: (d / "state.json").write_text("2"))
    assert (out / "state.json").read_text() == "2"

    def boom(d):
        (d / "part").write_text("x")
        raise RuntimeError("fill failed")

    with pytest.raises(RuntimeError):
        io.atomic_write_dir(out, boom)
    assert listing(tmp_path) == ["ds"] and listing(out) == ["state.json"]
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "precious.txt").write_text("keep")
    with pytest.raises(OutputError, match="refusing"):
        io.atomic_write_dir(tmp_path / "home", lambda d: None)
    assert listing(tmp_path / "home") == ["precious.txt"]


def test_sha256(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(b"abc" * 1000)
    assert io.sha256_file(p, chunk=7) == hashlib.sha256(b"abc" * 1000).hexdigest()
    with pytest.raises(InputError):
        io.sha256_file(tmp_path / "missing")
    d = tmp_path / "dir"
    d.mkdir()
    (d / "a").write_text("1")
    before = io.sha256_file(d)
    (d / "a").write_text("2")
    assert io.sha256_file(d) != before
    assert io.sha256_json({"a": 1, "b": [1, 2]}) == io.sha256_json({"b": [1, 2], "a": 1})
    assert io.sha256_json({"a": 1}) != io.sha256_json({"a": 2})
