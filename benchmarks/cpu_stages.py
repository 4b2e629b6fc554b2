"""CPU time and wall time of each stage of one `prism-select` command, in one process.

    python benchmarks/cpu_stages.py --json out.json -- demo --out /tmp/d --overwrite --no-progress
    python benchmarks/cpu_stages.py -- demo --out /tmp/d --pool-size 1000 --overwrite --no-progress

The stages are timed by wrapping the library's functions (model load, target direction,
the fit's two passes, curvature save or load, preconditioning, scoring; IF-Guide's target
and token scores); the eigendecompositions
are the rest of the curvature stage (their workers overlap, so they are not timed call
by call). Each stage also records the resident memory at its start and end and the
process's peak RSS so far (so the stage that set the peak shows). CPU seconds are the
process's user + system time over all threads, which on a machine shared with other work
says more than wall time. Set ``$PRISM_SELECT_CACHE`` to an empty directory to include
the model conversion and the fit (a cached curvature is
reused). Prints a table and writes ``--json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the CLI does, before torch loads
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


_WAITS: dict = {}  # thread id -> its runqueue wait (ns) when last read
_WAITS_LOCK = threading.Lock()


def runqueue_wait_s() -> float:
    """Seconds this process's threads have waited for a CPU while runnable (the kernel's
    schedstat): on a shared machine, the time other work took from this run. Threads
    that have exited count with their last reading (the RSS sampler reads every thread
    every --rss-every seconds, so a worker pool's threads are not lost when they end)."""
    with _WAITS_LOCK:
        for d in Path("/proc/self/task").iterdir():
            try:
                _WAITS[d.name] = int((d / "schedstat").read_text().split()[1])
            except (OSError, IndexError, ValueError):
                pass  # a thread that has just exited
        return sum(_WAITS.values()) / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--rss-every", type=float, default=0.5,
                    help="sample the resident memory every this many seconds (0: off); the samples, "
                         "with the stage running, go to --json as rss_trace")
    ap.add_argument("argv", nargs="+", help="the prism-select command line (after --)")
    a = ap.parse_args()
    from prism_select import cli
    from prism_select.methods import prism
    from prism_select.run import curvature_provider, job, scorer, split_half
    from prism_select.curvature import base, fit, store

    rec: dict = {}
    stack = ["start"]
    trace: list = []  # (seconds, RSS MiB, innermost stage) every --rss-every seconds

    def sample():
        t0 = time.perf_counter()
        while True:
            trace.append((round(time.perf_counter() - t0, 2), round(rss_mib()), stack[-1]))
            runqueue_wait_s()  # keeps the threads' waits (see there)
            time.sleep(a.rss_every)

    if a.rss_every > 0:
        threading.Thread(target=sample, daemon=True).start()

    def wrap(owner, name, label):
        f = getattr(owner, name)

        @functools.wraps(f)
        def g(*args, **kw):
            c, w, m0, q = time.process_time(), time.perf_counter(), rss_mib(), runqueue_wait_s()
            k0 = resource.getrusage(resource.RUSAGE_SELF).ru_stime
            stack.append(label(args) if callable(label) else label)
            try:
                return f(*args, **kw)
            finally:
                stack.pop()
                lab = label(args) if callable(label) else label
                r = rec.setdefault(lab, {"cpu_s": 0.0, "wall_s": 0.0, "wait_s": 0.0, "sys_s": 0.0})
                r["cpu_s"] += time.process_time() - c
                r["sys_s"] += resource.getrusage(resource.RUSAGE_SELF).ru_stime - k0  # kernel: file I/O, page faults
                r["wall_s"] += time.perf_counter() - w
                r["wait_s"] += runqueue_wait_s() - q
                # resident memory when the stage began and ended, and the process's peak so far
                r["rss_mib_start"], r["rss_mib_end"] = m0, rss_mib()
                r["peak_rss_mib_so_far"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        setattr(owner, name, g)

    wrap(job, "load_model", "load model")
    wrap(prism, "compute_preference", "target direction")
    wrap(fit, "_passes", lambda args: "fit: " + args[7].split(" (")[0])
    if hasattr(fit, "_spilled_pass"):  # the eigenvalue pass read from the factor pass's spill
        wrap(fit, "_spilled_pass", lambda args: "fit: " + args[3].split(" (")[0])
    if hasattr(fit, "_spilled_groups"):  # factors, eigendecompositions and eigenvalues from the spill
        wrap(fit, "_spilled_groups", "fit: factors, eigh, eigenvalues (spill)")
    if hasattr(fit, "_finish_lambda"):
        wrap(fit, "_finish_lambda", "fit: Lambda and its variance")
    wrap(base.Curvature, "save", "curvature save")
    wrap(store, "fit_curvature", "fit_curvature (all)")
    wrap(fit, "apply_damping", "apply damping")  # the fit's
    wrap(store, "apply_damping", "apply damping")  # a reused fit's
    wrap(curvature_provider, "load_or_fit_curvature", "curvature (all)")
    wrap(split_half, "load_or_fit_curvature", "curvature (all)")  # the split-half check's halves
    wrap(base.Curvature, "precondition", "precondition")
    wrap(scorer, "score_encoded", "scoring")
    wrap(split_half, "score_encoded", "scoring")  # the split-half check's sample
    wrap(base.Curvature, "load", "curvature load (cache)")
    from prism_select.methods import ifguide  # IF-Guide's own stages (score --method ifguide)
    wrap(ifguide, "contrastive_target", "IF-Guide target")
    wrap(ifguide, "token_scores", "IF-Guide token scores")
    if hasattr(fit._Spill, "scores"):  # exact scores from the fit's spill (the pool is the fit sample)
        wrap(fit._Spill, "scores", "scoring (from the fit's spill)")
    # spill.FitScores (the pool scored inside the spilled fit's tasks) is not a stage of its own:
    # its work runs on the fit's workers, within "fit: factors, eigh, eigenvalues (spill)"
    # (the answered probe fit_phases.py timed it per thread: `git show 0b0d5df:benchmarks/fit_phases.py`)
    c, w, q = time.process_time(), time.perf_counter(), runqueue_wait_s()
    k0 = resource.getrusage(resource.RUSAGE_SELF).ru_stime
    load0 = os.getloadavg()
    code = cli.main(a.argv)
    rec["total"] = {"cpu_s": time.process_time() - c, "wall_s": time.perf_counter() - w,
                    "wait_s": runqueue_wait_s() - q, "sys_s": resource.getrusage(resource.RUSAGE_SELF).ru_stime - k0}
    if "curvature (all)" in rec:
        parts = [v for k, v in rec.items() if k.startswith("fit: ") or k == "curvature save"]
        rec["eigendecompositions (rest of curvature)"] = {
            k: rec["curvature (all)"][k] - sum(p[k] for p in parts) for k in ("cpu_s", "wall_s", "wait_s", "sys_s")}
        if "fit: factors, eigh, eigenvalues (spill)" in rec:  # the eigendecompositions are in that stage
            rec["rest of curvature"] = rec.pop("eigendecompositions (rest of curvature)")
    ru = resource.getrusage(resource.RUSAGE_SELF)
    # wait s: the threads' time runnable but waiting for a CPU (other work on the machine)
    print(f"{'stage':42s} {'CPU s':>8s} {'(sys)':>8s} {'wall s':>8s} {'wait s':>8s} {'RSS MiB start/end, peak so far':>32s}")
    for k, v in rec.items():
        mem = (f"{v['rss_mib_start']:8.0f} {v['rss_mib_end']:8.0f} {v['peak_rss_mib_so_far']:8.0f}"
               if "rss_mib_start" in v else "")
        print(f"{k:42s} {v['cpu_s']:8.1f} {v.get('sys_s', 0):8.1f} {v['wall_s']:8.1f} {v['wait_s']:8.1f} {mem}")
    info = {"argv": a.argv, "exit_code": code, "stages": rec, "peak_rss_mib": ru.ru_maxrss / 1024,
            "load_average_start": load0, "load_average_end": os.getloadavg(), "cpus": os.cpu_count(),
            "threads": __import__("torch").get_num_threads()}
    print(f"peak RSS {info['peak_rss_mib']:.0f} MiB; load average at the end {info['load_average_end']}")
    if trace:
        top = max(trace, key=lambda x: x[1])
        info["rss_trace_peak"] = top
        info["rss_trace"] = trace
        print(f"highest sampled RSS {top[1]} MiB at {top[0]} s, in stage {top[2]!r}")
    if a.json:
        Path(a.json).write_text(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
