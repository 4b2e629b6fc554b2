"""The readers under hostile bytes: random bytes in every format, one huge line, JSON nested
deeper than Python's recursion limit. Each file ends in records or a named error
(:class:`~prism_select.errors.PrismError`), and the Python memory a read takes stays within
a small multiple of the file's size (tracemalloc's peak; the readers are Python)."""

import tempfile
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prism_select.data import load_pool, load_targets
from prism_select.errors import InputError, PrismError

#: a read holds the file's bytes, their decoded text and the parsed values at once, each
#: at most a few times the file (Python strings take up to 4 bytes a character)
MEMORY_PER_FILE_BYTE = 12
#: what a read of a tiny file may take whatever its size: the parser's own state, error texts
MEMORY_BASE_BYTES = 1 << 20
#: one line of this many bytes (the issue's 50-million-character record, scaled to a test)
HUGE_LINE_BYTES = 8 << 20
#: nesting far beyond the interpreter's recursion limit
DEEP = 200_000


def _read_all(path: Path) -> None:
    """Every loader, strict and skipping: records or a PrismError, nothing else."""
    for loader in (load_pool, load_targets):
        for skip in (False, True):
            try:
                loader(path, skip_invalid=skip)
            except PrismError:
                pass


def _peak_bytes(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _within_bound(path: Path) -> None:
    size = path.stat().st_size
    peak = _peak_bytes(lambda: _read_all(path))
    assert peak <= MEMORY_BASE_BYTES + MEMORY_PER_FILE_BYTE * size, (peak, size)


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.binary(max_size=2048), suffix=st.sampled_from([".jsonl", ".json", ".csv", ".parquet"]))
def test_random_bytes_end_in_records_or_a_named_error(data, suffix):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / f"pool{suffix}"
        path.write_bytes(data)
        _read_all(path)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(lines=st.lists(st.binary(max_size=200) | st.text(max_size=200).map(str.encode), max_size=8),
       suffix=st.sampled_from([".jsonl", ".csv"]))
def test_random_lines_stay_within_the_memory_bound(lines, suffix):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / f"pool{suffix}"
        path.write_bytes(b"\n".join(lines))
        _within_bound(path)


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv"])
@pytest.mark.parametrize("what", ["a valid record", "garbage"])
def test_one_huge_line_stays_within_the_memory_bound(tmp_path, suffix, what):
    path = tmp_path / f"pool{suffix}"
    if what == "garbage":
        path.write_bytes(b"{\"prompt\": \"" + b"\xff\x00x" * (HUGE_LINE_BYTES // 3))
    elif suffix == ".csv":
        path.write_bytes(b"prompt,response\nq," + b"a" * HUGE_LINE_BYTES + b"\n")
    else:
        record = b'{"prompt": "q", "response": "' + b"a" * HUGE_LINE_BYTES + b'"}'
        path.write_bytes(b"[" + record + b"]" if suffix == ".json" else record + b"\n")
    _within_bound(path)


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv"])
@pytest.mark.parametrize("bracket", ["[", "{\"a\": "])
def test_json_nested_beyond_the_recursion_limit_is_a_named_error(tmp_path, suffix, bracket):
    closing = "]" if bracket == "[" else "}"
    deep = bracket * DEEP + "1" + closing * DEEP
    path = tmp_path / f"pool{suffix}"
    if suffix == ".csv":  # a message list in a cell: decoded as JSON
        path.write_text('prompt,response,messages\nq,a,"' + deep.replace('"', '""') + '"\n')
    else:
        path.write_text(("[" + deep + "]") if suffix == ".json" else '{"prompt": "q", "response": ' + deep + "}\n")
    with pytest.raises(InputError) as e:
        load_pool(path)
    assert str(path) in str(e.value) and "fix:" in str(e.value)
    _within_bound(path)
