"""What the wrong answers of a dropped-carry repair experiment are: for each retrained row
(Mixed, Oracle, each method's removal at each fraction), the wrong answers on the carry
probes and on the no-carry probes, counted by how far the stated sum is from the true one:
-10 (a carry dropped: the harmful behaviour), +10 (a carry added where none is due) or
another offset. The stated sum is read as the probes' checker reads it
(``extract_final_number``). Read from the run folder's finished retrainings that started
from the seed's own start model (every data seed and fine-tuning seed pooled; as
``repair_rows_from_files.py`` counts them); nothing is trained or scored.

    python experiments/carry_offsets.py RUN_DIR [--targets probes] [--json OUT.json]

A removal that lowers the carry probes' error rate by teaching the model to carry more
eagerly shows as +10 answers on the no-carry probes.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from prism_select.evaluation.experiment import read_jsonl  # noqa: E402
from prism_select.evaluation.probes import extract_final_number  # noqa: E402
from prism_select.evaluation.repair import _retrain_dir  # noqa: E402
from repair_rows_from_files import start_model, started_from  # noqa: E402

#: the offsets named in the table; any other wrong sum (or none) counts as "other"
OFFSETS = {-10: "-10", 10: "+10"}


def offsets(responses: Path, probes: dict) -> dict:
    """``task -> Counter`` of ``right`` and the wrong answers' offsets for one retraining."""
    out: dict = {}
    for r in read_jsonl(responses):
        p = probes[r["id"]]
        c = out.setdefault(p["task"], Counter())
        if r["correct"]:
            c["right"] += 1
            continue
        got = extract_final_number(r["response"])
        c["other" if got is None else OFFSETS.get(got - (p["a"] + p["b"]), "other")] += 1
    return out


def _finished(d: Path, model: str | None) -> Path | None:
    """``d``'s judged responses when its retraining finished and started from ``model``."""
    f = d / "responses.jsonl"
    return f if f.is_file() and (d / ".responses-step.json").is_file() and started_from(d, model) else None


def rows(run_dir: Path, targets: str = "probes") -> dict:
    """``row -> task -> Counter`` over every seed and fine-tuning seed of ``run_dir``."""
    table: dict = {}
    for seed_dir in sorted(run_dir.glob("runs/*/seed*")):
        probes = {p["id"]: p for p in read_jsonl(seed_dir / "probes.jsonl")}
        model = start_model(seed_dir)
        kept = {"Mixed": seed_dir / "pool.jsonl", "Oracle": seed_dir / "oracle" / "kept.jsonl"}
        for kdir in sorted((seed_dir / targets / "removal").glob("k*")):
            for mdir in sorted(p for p in kdir.iterdir() if (p / "kept.jsonl").is_file()):
                kept[f"{mdir.name} (top {kdir.name[1:]}%)"] = mdir / "kept.jsonl"
        for name, path in kept.items():
            if not path.is_file():
                continue
            base = _retrain_dir(seed_dir, path)
            for d in [base, *sorted(base.parent.glob(base.name + "-ft*"))]:
                resp = _finished(d, model)
                if resp is None:
                    continue
                for task, c in offsets(resp, probes).items():
                    table.setdefault(name, {}).setdefault(task, Counter()).update(c)
    return table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--targets", default="probes", help="the target set whose removals are read")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    table = rows(a.run_dir, a.targets)
    if not table:
        print(f"no finished retrainings under {a.run_dir}/runs/*/seed*/", file=sys.stderr)
        return 1
    tasks = sorted({t for by in table.values() for t in by})
    cols = ["right", "-10", "+10", "other"]
    print("| row | " + " | ".join(f"{t}: {c}" for t in tasks for c in cols) + " |")
    print("|---|" + "---|" * (len(tasks) * len(cols)))
    for name, by in table.items():
        print(f"| {name} | " + " | ".join(str(by.get(t, Counter())[c]) for t in tasks for c in cols) + " |")
    if a.json:
        a.json.write_text(json.dumps({n: {t: dict(c) for t, c in by.items()} for n, by in table.items()},
                                     indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
