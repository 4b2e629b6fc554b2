"""Host memory of `prism-select compare`: peak RSS per method at several pool sizes on the
CPU, each method in its own process (so each peak is that method's), side by side in
one run, and optionally the whole `compare` over every method in one process.

    python benchmarks/bench_compare_memory.py --sizes 60,1000 --json out.json
    python benchmarks/bench_compare_memory.py --sizes 60 --methods prism,random --compare
    python benchmarks/bench_compare_memory.py --sizes 1000 --jobs 9 --threads 4 --cpus 16-63 \
        --method-threads less=12 --json out.json      # the methods side by side (a large host)

Pool and targets: the generated arithmetic example (``prism_select.examples``: real
text, a quarter of the answers wrong) at each size, 8 target pairs. Model: ``--model``
(default: the embedded SmolLM2-135M GGUF). Per size, one curvature cache is shared by
the methods in the order given, as in `compare` (the first gradient method fits and
saves, the next ones load). The converted model comes from ``--models-from`` (default:
the user's cache, linked into each size's cache directory; ``none``: converted by the
first method, whose peak then includes the conversion). Peak RSS is ``ru_maxrss`` of the child (the whole run:
imports, model, fit or load, scoring, writing); CPU seconds are user + system of the
child. Prints a table and writes ``--json``.

``--jobs N`` runs up to N methods side by side, each with ``--threads`` threads (or its
``--method-threads``) on CPUs of its own from ``--cpus``, and each with its own
curvature cache: every gradient method then fits the curvature itself, as the first
gradient method of a `compare` does, so its peak is at least its peak inside `compare`.
While they run, the JSON holds each running method's high-water mark so far (``VmHWM``,
read every ``--sample-s`` seconds, ``"running": true``).
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
    ap.add_argument("--jobs", type=int, default=1, help="methods run side by side (each with its own cache)")
    ap.add_argument("--threads", type=int, default=None, help="threads of each run (default: torch's)")
    ap.add_argument("--method-threads", action="append", default=[], metavar="METHOD=N",
                    help="threads of one method's run (repeatable)")
    ap.add_argument("--cpus", default=None, help="CPUs the runs are pinned to, e.g. 16-63 (each run its own)")
    ap.add_argument("--sample-s", type=float, default=10.0)
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

    per_method = {k: int(v) for k, v in (x.split("=", 1) for x in a.method_threads)}
    free_cpus = _cpu_list(a.cpus) if a.cpus else None
    running: list = []  # (row, process, cpus)

    def threads_of(name):
        return per_method.get(name, a.threads)

    def write():
        if a.json:
            live = [{**row, "running": True, "peak_rss_mib": _hwm_mib(p.pid), "wall_s": time.time() - row["t0"]}
                    for row, p, _ in running]
            Path(a.json).write_text(json.dumps(rows + live, indent=1, default=str))

    def finish(row, p, cpus):
        out, err = p.communicate()
        last = out.strip().splitlines()[-1] if out.strip() else "{}"
        row.update(json.loads(last), load_average_end=os.getloadavg())
        if p.returncode != 0 or row.get("code"):
            row["error"] = err.strip().splitlines()[-1:] or ["exit %d" % p.returncode]
        row.pop("t0", None)
        rows.append(row)
        if free_cpus is not None:
            free_cpus.extend(cpus)
        print(f"{row['records']:>6} {row['method']:>12}: peak RSS {row.get('peak_rss_mib', float('nan')):8.1f} MiB, "
              f"{row.get('wall_s', float('nan')):7.1f} s wall, {row.get('cpu_s', float('nan')):7.1f} s CPU"
              + (f"  ERROR {row['error']}" if "error" in row else ""), flush=True)
        write()

    def wait(limit):  # until fewer than `limit` runs are running (none, for 0 or 1)
        while True:
            for item in [i for i in running if i[1].poll() is not None]:
                running.remove(item)
                finish(*item)
            write()
            if len(running) <= max(limit - 1, 0):
                return
            time.sleep(a.sample_s)

    def run(size, name, argv):
        wait(a.jobs)
        n = threads_of(name)
        child_env = dict(env, **({"OMP_NUM_THREADS": str(n), "MKL_NUM_THREADS": str(n)} if n else {}))
        cpus = []
        if free_cpus is not None:
            want = n or 1
            if len(free_cpus) < want:
                raise SystemExit(f"--cpus: {len(free_cpus)} free CPUs left, {name} needs {want}")
            cpus, free_cpus[:] = free_cpus[:want], free_cpus[want:]
        cmd = [sys.executable, __file__, "--child", "--", *argv]
        p = subprocess.Popen(cmd, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
        row = {"records": size, "method": name, "threads": n, "t0": time.time()}
        running.append((row, p, cpus))
        if a.jobs <= 1:
            wait(0)

    from prism_select.model import default_cache_dir
    models = None if a.models_from == "none" else Path(a.models_from or default_cache_dir() / "models")
    for size in [int(x) for x in a.sizes.split(",") if x]:
        pool, targets = make_example(d / f"data{size}", n_pool=size, n_pairs=8)
        link = d / f"cache{size}" / "models"
        if models is not None and models.is_dir() and not link.exists():
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(models.resolve(), target_is_directory=True)
        common = ["--model", a.model, "--pool", str(pool), "--targets", str(targets), "--device", "cpu",
                  "--batch-size", str(a.batch_size), "--no-progress", "--overwrite"]

        def cache(name):  # side by side, each run its own cache (its models linked as the shared one's)
            c = d / f"cache{size}"
            if a.jobs > 1:
                c = d / f"cache{size}-{name}"
                if link.exists() and not (c / "models").exists():
                    c.mkdir(parents=True, exist_ok=True)
                    (c / "models").symlink_to(link.resolve(), target_is_directory=True)
            return ["--cache-dir", str(c)]

        if a.max_length:
            common += ["--max-length", str(a.max_length)]
        if a.fit_examples:
            common += ["--fit-examples", str(a.fit_examples)]
        for o in a.option:
            common += ["--option", o]
        for m in [] if a.compare_only else methods:
            run(size, m, ["score", "--method", m, "--out", str(d / f"run{size}" / m), *common, *cache(m)])
        if a.compare or a.compare_only:
            run(size, "compare(all)", ["compare", "--methods", *methods, "--label", "harmful",
                                       "--out", str(d / f"compare{size}"), *common, *cache("compare")])
    wait(0)
    print("| records | method | peak RSS MiB | wall s | CPU s |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['records']} | {r['method']} | {r.get('peak_rss_mib', float('nan')):.0f} | "
              f"{r.get('wall_s', float('nan')):.1f} | {r.get('cpu_s', float('nan')):.1f} |"
              + (" error |" if "error" in r else ""))


def _cpu_list(spec: str) -> list:
    """``"0-3,8"`` -> ``[0, 1, 2, 3, 8]``."""
    out = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def _hwm_mib(pid: int) -> float | None:
    """A running process's high-water mark of resident memory (``VmHWM``), MiB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


if __name__ == "__main__":
    main()
