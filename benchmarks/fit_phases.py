"""Per-phase thread CPU time inside one `prism-select` command, by wrapping the fit's
inner functions (eigendecompositions by width, factor products, rotations, the
per-example eigenvalue products, spill reads, finite checks) and the big stages.

    python benchmarks/fit_phases.py --json out.json -- demo --out /tmp/d --overwrite --no-progress

Each wrapped call adds the CPU time of the thread that ran it (``time.thread_time``), so
the spilled fit's one-thread workers are counted exactly, whatever else runs on the
machine (CPU seconds grow somewhat with contention: shared caches). Calls nest: "S gram"
includes the grams of the A products of the same width. The stages marked "main thread
only" count their calling thread, not the OpenMP workers. Set ``$PRISM_SELECT_CACHE`` to a
directory without a fitted curvature (link ``models`` from your cache) so that the fit runs.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the CLI does, before torch loads
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("argv", nargs="+", help="the prism-select command line (after --)")
    a = ap.parse_args()
    from prism_select import cli
    from prism_select.methods import prism
    from prism_select.curvature import base, eigenvalues, eigh, factors, fit, sharded, spill

    acc: dict = collections.defaultdict(lambda: [0.0, 0])
    lock = threading.Lock()

    def wrap(owner, name, label):
        f = getattr(owner, name)

        @functools.wraps(f)
        def g(*args, **kw):
            t = time.thread_time()
            try:
                return f(*args, **kw)
            finally:
                dt = time.thread_time() - t
                lab = label(args) if callable(label) else label
                with lock:
                    acc[lab][0] += dt
                    acc[lab][1] += 1
        setattr(owner, name, g)

    # each name where its callers look it up (the fit's modules import it by name)
    for mod in (fit, eigh, factors, eigenvalues, sharded, spill):
        for name, label in (("_eigh", lambda x: f"eigh {x[0].shape[0]}"),
                            ("_input_product", lambda x: f"A product {x[0].shape[-1]}"),
                            ("_gram_into", lambda x: f"S gram {x[1].shape[-1]}"),
                            ("_rotate", lambda x: f"rotate {x[1].shape[0]}"),
                            ("release_host_memory", "release_host_memory"),
                            ("check_finite", "check_finite")):
            if hasattr(mod, name):
                wrap(mod, name, label)
    wrap(spill._Spill, "read", "spill read")
    wrap(eigenvalues._LambdaTap, "add", lambda x: f"lambda add {x[2].shape[-1]}x{x[1].shape[-1]}")
    wrap(prism, "compute_preference", "target direction (main thread only)")
    wrap(fit, "_passes", "fit passes (main thread only)")
    wrap(spill._Spill, "scores", "scores from the spill (main thread only)")
    wrap(spill.FitScores, "score_layer", "scores inside the fit (per layer)")  # the pool scored inside the fit
    wrap(base.Curvature, "precondition", "precondition (main thread only)")
    c0, w0, load0 = time.process_time(), time.perf_counter(), os.getloadavg()
    code = cli.main(a.argv)
    info = {"argv": a.argv, "exit_code": code, "process_cpu_s": time.process_time() - c0,
            "wall_s": time.perf_counter() - w0, "load_average_start": load0, "load_average_end": os.getloadavg(),
            "phases": {k: {"thread_cpu_s": v[0], "calls": v[1]} for k, v in sorted(acc.items(), key=lambda x: -x[1][0])}}
    print(f"process {info['process_cpu_s']:.1f} CPU-s, {info['wall_s']:.1f} s wall, load {load0} -> "
          f"{info['load_average_end']}")
    for k, v in info["phases"].items():
        print(f"{k:42s} {v['thread_cpu_s']:8.2f} s  {v['calls']:6d} calls")
    if a.json:
        Path(a.json).write_text(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
