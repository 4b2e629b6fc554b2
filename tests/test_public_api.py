"""The public face (``import prism_select as ps``): README's Python example runs as written,
on a tiny model in place of ``"default"``; the names resolve lazily."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import PAIRS, POOL
from tiny import save_tiny

ROOT = Path(__file__).resolve().parents[1]


def readme_python() -> str:
    """The code block under README's "From Python"."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## From Python"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_example_is_three_lines_and_runs(tmp_path, monkeypatch):
    code = readme_python()
    assert len(code.strip().splitlines()) == 3
    model = save_tiny(tmp_path / "model")
    with open(tmp_path / "pool.jsonl", "w") as f:
        for i, (p, r) in enumerate(POOL * 4):
            f.write(json.dumps({"id": f"z{i}", "prompt": p, "response": r}) + "\n")
    with open(tmp_path / "targets.jsonl", "w") as f:
        for q, c, r in PAIRS:
            f.write(json.dumps({"prompt": q, "chosen": c, "rejected": r}) + "\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PRISM_SELECT_CACHE", str(tmp_path / "cache"))
    assert '"default"' in code
    exec(compile(code.replace('"default"', repr(str(model))), "README.md", "exec"), {})
    scores = [json.loads(line) for line in (tmp_path / "runs/prism/scores.jsonl").read_text().splitlines()]
    kept = (tmp_path / "selected.jsonl").read_text().splitlines()
    assert len(scores) == len(POOL) * 4
    n = -(-len(scores) * 5 // 100)  # 5%, rounded up
    assert len(kept) == n
    top = {s["id"] for s in scores if s["rank"] <= n}
    assert {json.loads(line)["id"] for line in kept} == top


def test_public_names_resolve_and_import_is_light():
    import prism_select as ps
    from prism_select.run.compare import compare
    from prism_select.settings import ScoreSettings
    from prism_select.selection import select

    assert ps.select is select and ps.compare is compare and ps.ScoreSettings is ScoreSettings
    assert set(ps.__all__) <= set(dir(ps))
    with pytest.raises(AttributeError, match="no attribute 'nonesuch'"):
        ps.nonesuch
    # importing the package alone loads neither torch nor the score job (prism_select.run)
    out = subprocess.run([sys.executable, "-c", "import sys, prism_select; "
                          "print('torch' in sys.modules, 'prism_select.run' in sys.modules)"],
                         capture_output=True, text=True, cwd=ROOT, check=True).stdout.split()
    assert out == ["False", "False"]
