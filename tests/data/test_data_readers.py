"""Reading pool and target files: formats, record forms, validation errors."""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prism_select.data import (
    InvalidRecord,
    PoolExample,
    TargetPair,
    detect_format,
    iter_records,
    load_pool,
    load_targets,
)
from prism_select.errors import InputError, PrismError

from record_files import FORMATS, SUFFIX, write, write_lines

POOL = [{"id": f"ex{i}", "prompt": f"question {i}", "response": f"answer {i}", "meta": i}
        for i in range(4)]
MSGS = [{"messages": [{"role": "system", "content": "be brief"},
                      {"role": "user", "content": f"q{i}"},
                      {"role": "assistant", "content": f"a{i}"}]} for i in range(3)]
TARGETS = [{"id": i, "prompt": f"q{i}", "chosen": f"good {i}", "rejected": f"bad {i}",
            "task": "t" + str(i % 2)} for i in range(3)]


# ------------------------------------------------------------------ formats

@pytest.mark.parametrize("fmt", FORMATS)
def test_detect_format(tmp_path, fmt):
    assert detect_format(write(tmp_path / "p", fmt, POOL)) == fmt


def test_detect_format_ndjson_and_errors(tmp_path):
    assert detect_format(write_lines(tmp_path / "p.ndjson", POOL)) == "jsonl"
    (tmp_path / "p.txt").write_text("x")
    with pytest.raises(InputError, match="unknown file format") as e:
        detect_format(tmp_path / "p.txt")
    assert "Parquet" in str(e.value) and e.value.path == str(tmp_path / "p.txt")
    with pytest.raises(InputError, match="not found"):
        detect_format(tmp_path / "missing.jsonl")
    (tmp_path / "d").mkdir()
    with pytest.raises(InputError, match="save_to_disk"):
        detect_format(tmp_path / "d")


@pytest.mark.parametrize("fmt", FORMATS)
def test_pool_roundtrip(tmp_path, fmt):
    loaded = load_pool(write(tmp_path / "p", fmt, POOL))
    assert loaded.format == fmt and loaded.invalid == []
    assert loaded.items == [PoolExample(f"ex{i}", f"question {i}", f"answer {i}", i)
                            for i in range(4)]


@pytest.mark.parametrize("fmt", FORMATS)
def test_pool_messages_roundtrip(tmp_path, fmt):
    items = load_pool(write(tmp_path / "p", fmt, MSGS)).items
    assert [x.id for x in items] == [0, 1, 2]  # ids default to row numbers
    assert items[1].prompt == [{"role": "system", "content": "be brief"},
                               {"role": "user", "content": "q1"}]
    assert items[1].response == "a1"


@pytest.mark.parametrize("fmt", FORMATS)
def test_targets_roundtrip(tmp_path, fmt):
    loaded = load_targets(write(tmp_path / "t", fmt, TARGETS))
    ids = [str(i) if fmt == "csv" else i for i in range(3)]  # CSV values are text
    assert loaded.items == [TargetPair(ids[i], f"q{i}", f"good {i}", f"bad {i}", i, f"t{i % 2}")
                            for i in range(3)]


@pytest.mark.parametrize("fmt", FORMATS)
def test_targets_as_message_lists(tmp_path, fmt):
    recs = [{"prompt": [{"role": "user", "content": f"q{i}"}],
             "chosen": [{"role": "user", "content": f"q{i}"},
                        {"role": "assistant", "content": f"yes {i}"}],
             "rejected": [{"role": "user", "content": f"q{i}"},
                          {"role": "assistant", "content": f"no {i}"}]} for i in range(2)]
    items = load_targets(write(tmp_path / "t", fmt, recs)).items
    assert [(t.prompt, t.chosen, t.rejected, t.task) for t in items] == [
        ([{"role": "user", "content": f"q{i}"}], f"yes {i}", f"no {i}", None) for i in range(2)]


def test_targets_prompt_from_shared_prefix(tmp_path):
    turn = [{"role": "user", "content": "hi"}]
    rec = {"chosen": turn + [{"role": "assistant", "content": "hello"}],
           "rejected": turn + [{"role": "assistant", "content": "go away"}]}
    (t,) = load_targets(write_lines(tmp_path / "t.jsonl", [rec])).items
    assert (t.prompt, t.chosen, t.rejected) == (turn, "hello", "go away")


def test_json_object_with_one_list(tmp_path):
    p = tmp_path / "p.json"
    p.write_text(json.dumps({"version": 2, "data": POOL}))
    assert [x.id for x in load_pool(p).items] == ["ex0", "ex1", "ex2", "ex3"]
    p.write_text(json.dumps({"a": POOL, "b": POOL}))
    with pytest.raises(InputError, match="exactly one"):
        load_pool(p)
    p.write_text(json.dumps(POOL[0]))  # a bare record, not a list
    with pytest.raises(InputError, match="list"):
        load_pool(p)


def test_record_forms(tmp_path):
    recs = [
        {"prompt": "p0", "completion": "c0"},
        {"prompt": [{"role": "user", "content": "p1"}], "response": "r1"},
        {"instruction": "do it", "output": "done"},
        {"instruction": "do it", "input": "on this", "output": "done"},
        {"instruction": "do it", "input": "", "output": "done"},
        {"id": 7, "messages": [{"role": "user", "content": "u", "name": "x"},
                               {"role": "assistant", "content": "a"}], "extra": [1]},
    ]
    items = load_pool(write_lines(tmp_path / "p.jsonl", recs)).items
    assert [(x.id, x.prompt, x.response, x.row) for x in items] == [
        (0, "p0", "c0", 0),
        (1, [{"role": "user", "content": "p1"}], "r1", 1),
        (2, "do it", "done", 2),
        (3, "do it\n\non this", "done", 3),
        (4, "do it", "done", 4),
        (7, [{"role": "user", "content": "u"}], "a", 5),
    ]


def test_blank_lines_are_not_rows(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text("\n" + json.dumps(POOL[0] | {"id": None}) + "\n\n  \n"
                 + json.dumps({"prompt": "x", "response": "y"}) + "\n")
    assert [(x.id, x.row) for x in load_pool(p).items] == [(0, 0), (1, 1)]


def test_csv_text_starting_with_bracket_stays_text(tmp_path):
    p = tmp_path / "p.csv"
    p.write_text('prompt,response\n"[1, 2] sum?",3\n')
    assert load_pool(p).items[0].prompt == "[1, 2] sum?"


# ------------------------------------------------------------------ malformed records

M = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
BAD_POOL = [  # (record, field, message fragment)
    ({"text": "hi"}, None, "no recognised record form"),
    ({"prompt": "q"}, "response", "without 'response'"),
    ({"instruction": "q"}, "output", "without 'output'"),
    ({"prompt": "q", "response": 5}, "response", "got an integer"),
    ({"prompt": 3, "response": "a"}, "prompt", "got an integer"),
    ({"prompt": "  ", "response": "a"}, "prompt", "empty prompt"),
    ({"prompt": "q", "response": " \n"}, "response", "empty response"),
    ({"prompt": "q", "response": None}, "response", "got null"),
    ({"prompt": [], "response": "a"}, "prompt", "non-empty list"),
    ({"prompt": [{"role": "user", "content": ""}], "response": "a"}, "prompt", "empty prompt"),
    ({"messages": "hi"}, "messages", "list of messages"),
    ({"messages": M[1:]}, "messages", "at least one message before"),
    ({"messages": M[:1] * 2}, "messages", "expected 'assistant'"),
    ({"messages": [M[0], {"role": "assistant", "content": 1}]}, "messages", "'content'"),
    ({"messages": [M[0], "a"]}, "messages", "expected an object"),
    ({"messages": [{"content": "q"}, M[1]]}, "messages", "'role'"),
    ({"instruction": "q", "input": 4, "output": "a"}, "input", "got an integer"),
    ({"id": 1.5, "prompt": "q", "response": "a"}, "id", "string or an integer"),
    ({"id": [1], "prompt": "q", "response": "a"}, "id", "string or an integer"),
    ({"id": "", "prompt": "q", "response": "a"}, "id", "empty id"),
]


@pytest.mark.parametrize("rec,field,fragment", BAD_POOL)
def test_bad_pool_record(tmp_path, rec, field, fragment):
    p = write_lines(tmp_path / "p.jsonl", [POOL[0], POOL[1], rec])
    with pytest.raises(InputError, match=fragment) as e:
        load_pool(p)
    assert (e.value.path, e.value.row, e.value.field) == (str(p), 2, field)
    assert e.value.fix


BAD_TARGET = [
    ({"prompt": "q", "chosen": "a"}, "rejected", "missing field 'rejected'"),
    ({"chosen": "a", "rejected": "b"}, "prompt", "missing field 'prompt'"),
    ({"prompt": "q", "chosen": "same", "rejected": "same "}, "rejected", "same response"),
    ({"prompt": "q", "chosen": "", "rejected": "b"}, "chosen", "empty"),
    ({"prompt": "q", "chosen": "a", "rejected": 2}, "rejected", "got an integer"),
    ({"prompt": "q", "chosen": M[:1], "rejected": "b"}, "chosen", "expected 'assistant'"),
    ({"prompt": "q", "chosen": "a", "rejected": "b", "task": 3}, "task", "got an integer"),
]


@pytest.mark.parametrize("rec,field,fragment", BAD_TARGET)
def test_bad_target_record(tmp_path, rec, field, fragment):
    p = write_lines(tmp_path / "t.jsonl", [TARGETS[0], rec])
    with pytest.raises(InputError, match=fragment) as e:
        load_targets(p)
    assert (e.value.row, e.value.field) == (1, field)


def test_chosen_equals_rejected_fix(tmp_path):
    p = write_lines(tmp_path / "t.jsonl", [{"prompt": "q", "chosen": "x", "rejected": "x"}])
    with pytest.raises(InputError, match="must differ"):
        load_targets(p)


@pytest.mark.parametrize("loader", [load_pool, load_targets])
@pytest.mark.parametrize("name,content", [
    ("e.jsonl", b""), ("e.jsonl", b"\n  \n"), ("e.json", b"[]"), ("e.json", b"  "),
    ("e.csv", b""), ("e.csv", b"prompt,response\n")])
def test_empty_file(tmp_path, loader, name, content):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(InputError, match="no records") as e:
        loader(tmp_path / name, skip_invalid=True)  # whole-file problems always raise
    assert e.value.row is None


def test_invalid_json_names_row_and_line(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps(POOL[0]) + "\n\n" + json.dumps(POOL[1]) + "\n{oops\n")
    with pytest.raises(InputError, match="line 4: invalid JSON") as e:
        load_pool(p)
    assert e.value.row == 2


def test_invalid_json_file(tmp_path):
    p = tmp_path / "p.json"
    p.write_text('[\n {"prompt": "q",\n "response": }\n]')
    with pytest.raises(InputError, match="line 3"):
        load_pool(p)


def test_non_object_record(tmp_path):
    with pytest.raises(InputError, match="expected a JSON object, got a list") as e:
        load_pool(write_lines(tmp_path / "p.jsonl", [POOL[0], [1, 2]]))
    assert e.value.row == 1


def test_non_utf8_jsonl(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_bytes(json.dumps(POOL[0]).encode() + b'\n{"prompt": "caf\xe9", "response": "x"}\n')
    with pytest.raises(InputError, match="line 2: not UTF-8") as e:
        load_pool(p)
    assert e.value.row == 1


def test_non_utf8_csv(tmp_path):
    p = tmp_path / "p.csv"
    p.write_bytes(b'prompt,response\nq,a\n"multi\nline",ok\ncaf\xe9,x\n')
    with pytest.raises(InputError, match="line 5: not UTF-8") as e:
        load_pool(p)
    assert e.value.row == 2
    assert len(load_pool(p, skip_invalid=True).items) == 2


def test_non_utf8_json(tmp_path):
    p = tmp_path / "p.json"
    p.write_bytes(b'[\n{"prompt": "q", "response": "caf\xe9"}]')
    with pytest.raises(InputError, match="line 2: not UTF-8"):
        load_pool(p)


def test_csv_wrong_width(tmp_path):
    p = tmp_path / "p.csv"
    p.write_text("prompt,response\nq,a\nq,a,extra\n")
    with pytest.raises(InputError, match="3 cells but the header has 2") as e:
        load_pool(p)
    assert e.value.row == 1


@pytest.mark.parametrize("loader,recs", [
    (load_pool, [POOL[0], POOL[1], POOL[0]]),
    (load_targets, [TARGETS[0], TARGETS[0]]),
    (load_pool, [{"prompt": "q", "response": "a"}, {"id": 0, "prompt": "q", "response": "a"}]),
])
def test_duplicate_ids(tmp_path, loader, recs):
    p = write_lines(tmp_path / "p.jsonl", recs)
    with pytest.raises(InputError, match=rf"lines 1 and {len(recs)}") as e:
        loader(p, skip_invalid=True)  # ambiguous ids always raise
    assert e.value.field == "id"


def test_errors_name_the_line_an_editor_shows(tmp_path):
    """JSON Lines and CSV errors give the 1-based line of the record (blank lines and the
    CSV header counted, as an editor counts them); other formats the row counted from 1."""
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps(POOL[0]) + "\n\n" + json.dumps(POOL[1]) + "\n" + json.dumps({"prompt": "q"}) + "\n")
    with pytest.raises(InputError) as e:
        load_pool(p)
    assert str(e.value).startswith(f"{p}, line 4, field 'response': ") and e.value.row == 2
    assert load_pool(p, skip_invalid=True).invalid[0].to_json()["line"] == 4
    c = tmp_path / "p.csv"
    c.write_text('prompt,response\nq,a\n"multi\nline",ok\nq,\n')
    with pytest.raises(InputError, match=rf"^{re.escape(str(c))}, line 5, field 'response'"):
        load_pool(c)
    j = write(tmp_path / "j", "json", [POOL[0], {"prompt": "q"}])
    with pytest.raises(InputError, match=rf"^{re.escape(str(j))}, row 2, field 'response'"):
        load_pool(j)
    d = write_lines(tmp_path / "d.jsonl", [POOL[0], POOL[1], POOL[0]])
    with pytest.raises(InputError, match=r"d.jsonl, line 3, field 'id': duplicate id 'ex0': lines 1 and 3"):
        load_pool(d)


def test_skip_invalid_collects(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text("\n".join([json.dumps(POOL[0]), "{bad", json.dumps({"prompt": "q"}),
                            "7", json.dumps(POOL[1])]) + "\n")
    loaded = load_pool(p, skip_invalid=True)
    assert [x.id for x in loaded.items] == ["ex0", "ex1"]
    assert [(r.row, r.field) for r in loaded.invalid] == [(1, None), (2, "response"), (3, None)]
    assert all(isinstance(r, InvalidRecord) and r.path == str(p) for r in loaded.invalid)
    assert "invalid JSON" in loaded.invalid[0].reason
    assert loaded.invalid[1].to_json()["field"] == "response"


def test_skip_invalid_targets(tmp_path):
    p = write_lines(tmp_path / "t.jsonl", [TARGETS[0], {"prompt": "q", "chosen": "x",
                                                        "rejected": "x"}])
    loaded = load_targets(p, skip_invalid=True)
    assert len(loaded.items) == 1 and loaded.invalid[0].field == "rejected"


def test_all_invalid_raises(tmp_path):
    p = write_lines(tmp_path / "p.jsonl", [{"prompt": "q"}, "{bad"])
    with pytest.raises(InputError, match="all 2 are invalid"):
        load_pool(p, skip_invalid=True)


def test_iter_records_is_plain_python(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "p.parquet"
    pq.write_table(pa.table({"id": pa.array([1, 2], pa.int32()), "x": [1.5, None]}), p)
    rows = list(iter_records(p))
    assert rows == [(0, {"id": 1, "x": 1.5}), (1, {"id": 2, "x": None})]
    assert type(rows[0][1]["id"]) is int


# ------------------------------------------------------------------ property

KEYS = st.sampled_from(["id", "prompt", "response", "completion", "messages", "instruction",
                        "input", "output", "chosen", "rejected", "task", "role", "content"])
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5)
    | st.sampled_from(["user", "assistant", "", " "]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS | st.text(max_size=3),
                                                                 inner, max_size=5),
    max_leaves=20)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(values=st.lists(JSON, max_size=5), junk=st.none() | st.binary(max_size=40),
       suffix=st.sampled_from([".jsonl", ".json", ".csv"]))
def test_random_input_raises_only_prism_errors(values, junk, suffix):
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / ("f" + suffix)
        data = "".join(json.dumps(v) + "\n" for v in values).encode()
        p.write_bytes(data + (junk or b""))
        for loader in (load_pool, load_targets):
            for skip in (False, True):
                try:
                    loaded = loader(p, skip_invalid=skip)
                except PrismError:
                    continue
                assert loaded.items
