"""Helpers for the tests of the scripts under ``experiments/`` and ``benchmarks/`` (they are
files, not modules of the package): load one as a module; write a JSON-lines file."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_script(relpath: str):
    """The script at ``ROOT / relpath`` (e.g. ``experiments/carry_offsets.py``), imported."""
    path = ROOT / relpath
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def write_jsonl(path: Path, rows: list) -> Path:
    """``rows`` as JSON lines at ``path`` (its folders made)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
