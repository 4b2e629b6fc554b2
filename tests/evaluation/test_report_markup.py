"""A report page built from a run folder whose every value was planted by someone else
(run folders are sent between people): the page holds no executable markup, and a
scores.jsonl or run.json that ``select`` would refuse is refused by ``report`` too."""

import json
from html.parser import HTMLParser

import pytest

from prism_select import cli
from prism_select.evaluation.report import write_report

from fake_runs import fake_run, write_jsonl_rows

# Values that would run script (or close an element early) if put into a page unescaped.
PLANTED = ['<script>document.title="owned"</script>', '"onload="alert(1)', "</title><script>alert(2)</script>",
           "<img src=x onerror=alert(3)>", "javascript:alert(4)", "'><svg onload=alert(5)>"]


class _Markup(HTMLParser):
    """Elements, event-handler attributes and javascript: URLs of a page."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.scripts, self.handlers, self.js_urls, self.tags, self.title = 0, [], [], [], ""
        self._in_title = False

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.scripts += tag == "script"
        self._in_title = tag == "title"
        for name, value in attrs:
            if name.lower().startswith("on"):
                self.handlers.append((tag, name))
            if value and value.strip().lower().startswith("javascript:"):
                self.js_urls.append((tag, name, value))

    def handle_endtag(self, tag):
        self._in_title = self._in_title and tag != "title"

    def handle_data(self, data):
        if self._in_title:
            self.title += data


def _assert_inert(page, title):
    m = _Markup()
    m.feed(page.read_text(encoding="utf-8"))
    assert m.scripts == 0 and not m.handlers and not m.js_urls, (m.scripts, m.handlers, m.js_urls)
    assert not {"svg", "iframe", "object", "embed"} & set(m.tags), set(m.tags)
    assert m.title == title


def _planted_pool(tmp_path):
    return write_jsonl_rows(tmp_path / "pool.jsonl", [
        {"id": PLANTED[i % len(PLANTED)] + str(i), "prompt": PLANTED[(i + 1) % len(PLANTED)],
         "response": PLANTED[(i + 2) % len(PLANTED)], "harmful": i % 2 == 0} for i in range(8)])


def test_a_score_run_with_planted_values_gives_an_inert_page(tmp_path):
    pool = _planted_pool(tmp_path)
    run = fake_run(tmp_path / "run", pool, method=PLANTED[0],
                   counts={"pool": PLANTED[2], "pairs": PLANTED[3], "invalid": PLANTED[1]},
                   model={"model": PLANTED[4]}, curvature_settings={"kind": PLANTED[5]},
                   timings={"total_s": PLANTED[0]})
    write_jsonl_rows(run / "pairs.jsonl", [{"id": PLANTED[1], "pi": 0.25}, {"id": 2, "pi": 0.75}])
    page = write_report(run)
    _assert_inert(page, "prism-select score run")
    text = page.read_text()
    assert "&lt;/title&gt;&lt;script&gt;alert(2)" in text  # shown as text, not dropped


def test_a_compare_folder_with_planted_values_gives_an_inert_page(tmp_path):
    pool = _planted_pool(tmp_path)
    cmp = tmp_path / "cmp"
    for i, method in enumerate(["prism", "random"]):
        fake_run(cmp / method, pool, scores=[float(j * (-1) ** i) for j in range(8)], method=method)
    (cmp / "compare.json").write_text(json.dumps({
        "pool": str(pool), "targets": PLANTED[4], "label": "harmful", "n_pool": PLANTED[2],
        "model": {"path": PLANTED[0]}, "curvature_settings": {"kind": PLANTED[3]},
        "methods": [{"method": "prism", "wall_s": PLANTED[1]}, {"method": "random", "wall_s": 0.5}]}))
    page = write_report(cmp)
    _assert_inert(page, "prism-select compare")
    assert "&lt;/title&gt;&lt;script&gt;alert(2)&lt;/script&gt; pool examples" in page.read_text()


def test_an_experiment_with_planted_values_gives_an_inert_page(tmp_path):
    (tmp_path / "results.json").write_text(json.dumps({
        "protocol": PLANTED[2], "seeds": [PLANTED[0]], "methods": [PLANTED[1]],
        "config": {"model": {"model": PLANTED[3], "dtype": PLANTED[4]}, "curvature": {"kind": PLANTED[5]}},
        "tables": [{"name": PLANTED[1], "title": PLANTED[0], "columns": [PLANTED[2]],
                    "rows": [{"label": PLANTED[3], "cells": [{"mean": 0.5, "std": PLANTED[1], "n": PLANTED[0]}]}],
                    "note": PLANTED[5]}],
        "runs": [{"setting": PLANTED[0], "seed": PLANTED[1], "n_pool": PLANTED[2], "n_harmful": PLANTED[3],
                  "n_pairs": PLANTED[4], "pi": {"all": {"min": PLANTED[5], "max": 0.9}}, "note": PLANTED[0],
                  "methods": {"prism": {"status": "error", "error": PLANTED[2]}}}],
        "timings": {PLANTED[0]: PLANTED[1]}}))
    _assert_inert(write_report(tmp_path), "prism-select " + PLANTED[2])


def _fails(argv, capsys, *needles):
    assert cli.main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("prism-select: error: "), err
    for needle in needles:
        assert needle in err, err


@pytest.mark.parametrize("field, value", [("rank", "<script>alert(1)</script>"), ("rank", 0),
                                          ("score", "nan"), ("id", {"a": 1})])
def test_report_refuses_the_scores_that_select_refuses(tmp_path, capsys, field, value):
    pool = _planted_pool(tmp_path)
    run = fake_run(tmp_path / "run", pool)
    rows = [json.loads(line) for line in (run / "scores.jsonl").read_text().splitlines()]
    rows[3][field] = value
    write_jsonl_rows(run / "scores.jsonl", rows)
    for argv in (["report", "--run", run],
                 ["select", "--run", run, "--pool", pool, "--keep", "2", "--out", tmp_path / "kept.jsonl"]):
        _fails(argv, capsys, str(run / "scores.jsonl"), "row 4", f"invalid {field}")
    assert not (run / "report.html").exists() and not (tmp_path / "kept.jsonl").exists()


def test_report_refuses_a_compare_method_that_names_no_folder_beside_it(tmp_path, capsys):
    pool = _planted_pool(tmp_path)
    cmp = tmp_path / "cmp"
    fake_run(cmp / "prism", pool)
    (cmp / "compare.json").write_text(json.dumps({"pool": str(pool), "methods": [{"method": "../prism"}]}))
    _fails(["report", "--run", cmp], capsys, str(cmp / "compare.json"), "methods[0]")
