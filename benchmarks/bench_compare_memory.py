"""Host memory of `prism-select compare`: peak RSS per method at several pool sizes on the
CPU, each method in its own process (so each peak is that method's), side by side in
one run, and optionally the whole `compare` over every method in one process.

    python benchmarks/bench_compare_memory.py --sizes 60,1000 --json out.json
    python benchmarks/bench_compare_memory.py --sizes 60 --methods prism,random --compare

Pool and targets: the generated arithmetic example (``prism_select.examples``: real
text, a quarter of the answers wrong) at each size, 8 target pairs. Model: ``--model``
(default: the embedded SmolLM2-135M GGUF). Per size, one curvature cache is shared by
the methods in the order given, as in `compare` (the first gradient method fits and
saves, the next ones load). The converted model comes from ``--models-from`` (default:
the user's cache, linked into each size's cache directory; ``none``: converted by the
first method, whose peak then includes the conversion). Peak RSS is ``ru_maxrss`` of the child (the whole run:
imports, model, fit or load, scoring, writing); CPU seconds are user + system of the
child. Prints a table and writes ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: every method `compare` knows that runs without extra models or options
DEFAULT_METHODS = "prism,equal,unpaired,random,ifguide,vecfilter,projdiff,conceptinf,less"


def child(a):
    sys.path.insert(0, str(ROOT))
    from prism_select.cli import main
    t = time.perf_counter()
    code = main(a.argv)
    ru = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"code": code, "peak_rss_mib": ru.ru_maxrss / 1024, "wall_s": time.perf_counter() - t,
                      "cpu_s": ru.ru_utime + ru.ru_stime}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="60,1000")
    ap.add_argument("--methods", default=DEFAULT_METHODS)
    ap.add_argument("--model", default="default")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-length", type=int, default=None, help="passed to the runs (default: theirs)")
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help="passed to the runs as --option (repeatable)")
    ap.add_argument("--fit-examples", type=int, default=None,
                    help="passed to the runs: fit the curvature on a seeded sample of N pool records (default: "
                         "the whole pool; on 2 CPU cores a 1,000-record fit takes most of an hour)")
    ap.add_argument("--compare", action="store_true", help="also run `compare` over all methods in one process")
    ap.add_argument("--compare-only", action="store_true",
                    help="run only `compare` over all methods in one process (no run per method)")
    ap.add_argument("--dir", default="/tmp/prism-bench-compare-memory")
    ap.add_argument("--models-from", default=None,
                    help="a cache's converted models to link into each size's cache (default: the user's "
                         "cache; 'none': convert in the first run)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("argv", nargs="*", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a)
    sys.path.insert(0, str(ROOT))
    from prism_select.examples import make_example
    d = Path(a.dir)
    methods = [m for m in a.methods.split(",") if m]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(ROOT))
    rows = []

    def run(size, name, argv):
        cmd = [sys.executable, __file__, "--child", "--", *argv]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else "{}"
        row = {"records": size, "method": name, **json.loads(last), "load_average_end": os.getloadavg()}
        if r.returncode != 0 or row.get("code"):
            row["error"] = r.stderr.strip().splitlines()[-1:] or ["exit %d" % r.returncode]
        rows.append(row)
        print(f"{size:>6} {name:>12}: peak RSS {row.get('peak_rss_mib', float('nan')):8.1f} MiB, "
              f"{row.get('wall_s', float('nan')):7.1f} s wall, {row.get('cpu_s', float('nan')):7.1f} s CPU"
              + (f"  ERROR {row['error']}" if "error" in row else ""), flush=True)
        if a.json:
            Path(a.json).write_text(json.dumps(rows, indent=1))

    from prism_select.model import default_cache_dir
    models = None if a.models_from == "none" else Path(a.models_from or default_cache_dir() / "models")
    for size in [int(x) for x in a.sizes.split(",") if x]:
        pool, targets = make_example(d / f"data{size}", n_pool=size, n_pairs=8)
        link = d / f"cache{size}" / "models"
        if models is not None and models.is_dir() and not link.exists():
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(models.resolve(), target_is_directory=True)
        common = ["--model", a.model, "--pool", str(pool), "--targets", str(targets), "--device", "cpu",
                  "--batch-size", str(a.batch_size), "--cache-dir", str(d / f"cache{size}"), "--no-progress",
                  "--overwrite"]
        if a.max_length:
            common += ["--max-length", str(a.max_length)]
        if a.fit_examples:
            common += ["--fit-examples", str(a.fit_examples)]
        for o in a.option:
            common += ["--option", o]
        for m in [] if a.compare_only else methods:
            run(size, m, ["score", "--method", m, "--out", str(d / f"run{size}" / m), *common])
        if a.compare or a.compare_only:
            run(size, "compare(all)", ["compare", "--methods", *methods, "--label", "harmful",
                                       "--out", str(d / f"compare{size}"), *common])
    print("| records | method | peak RSS MiB | wall s | CPU s |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['records']} | {r['method']} | {r.get('peak_rss_mib', float('nan')):.0f} | "
              f"{r.get('wall_s', float('nan')):.1f} | {r.get('cpu_s', float('nan')):.1f} |"
              + (" error |" if "error" in r else ""))


if __name__ == "__main__":
    main()
