"""Resident memory and glibc heap figures of the demo, stage by stage and fit step by fit step
(the fit's host memory, docs/performance.md).

    PRISM_SELECT_CACHE=<empty but the converted model> python benchmarks/rss_probe.py 40 --json OUT.json
    python benchmarks/rss_probe.py 40 --full --json OUT.json          # the whole demo, not only the fit
    python benchmarks/rss_probe.py 1000 --full --every 0.1 --spill-max 8589934592 --json OUT.json

Runs ``prism-select demo --pool-size POOL`` in this process with the fit's spill bound set
to ``--spill-max`` (default 0: no spill, so the fit runs the model again in its eigenvalue
pass, the path a 1,000-record fit takes). Prints a JSON line at the start and end of each
fit pass and stage and after each fit step: RSS, and from glibc's ``mallinfo2`` the heap's
arenas (``arena``), its mmapped chunks (``mmap``), its live bytes (``used``) and the free
bytes it keeps (``free``), in MiB; a thread samples the RSS and the heap's live bytes
(used + mmap) every ``--every`` seconds and prints the peaks, and a TICK line every
minute. Without ``--full`` the process ends after the fit's ``_finish_lambda``.
``--trim-every-batch``: ``malloc_trim`` after each fit step. The library is imported from
this checkout.
"""
import ctypes, os, sys, time, json, threading
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
import argparse
ap = argparse.ArgumentParser()
ap.add_argument("pool", type=int)
ap.add_argument("--spill-max", type=int, default=0)
ap.add_argument("--trim-every-batch", action="store_true")
ap.add_argument("--json", default=None)
ap.add_argument("--out", default="/tmp/rss_probe", help="the demo's output directory goes under it")
ap.add_argument("--every", type=float, default=0.02)
ap.add_argument("--full", action="store_true", help="do not stop after the fit")
a = ap.parse_args()

from prism_select import cli
from prism_select.curvature import fit, spill
from prism_select import gradients

libc = ctypes.CDLL("libc.so.6")
class MI2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = MI2

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

def mi():
    m = libc.mallinfo2()
    M = 2**20
    return dict(arena=round(m.arena / M), mmap=round(m.hblkhd / M), used=round(m.uordblks / M),
                free=round(m.fordblks / M), nmmap=m.hblks)

log = []
def mark(what, **kw):
    e = dict(t=round(time.perf_counter() - T0, 1), what=what, rss=round(rss()), **mi(), **kw)
    log.append(e)
    print(json.dumps(e), flush=True)

T0 = time.perf_counter()
spill.SPILL_MAX_BYTES = a.spill_max
peak = [0, None]
peak_live = [0, None]
last = [0.0]
def sampler():
    while True:
        r = rss()
        m = libc.mallinfo2()
        live = (m.uordblks + m.hblkhd) / 2**20
        if live > peak_live[0]:
            peak_live[0], peak_live[1] = live, (round(time.perf_counter() - T0, 1), stage[-1])
        if r > peak[0]:
            peak[0], peak[1] = r, (round(time.perf_counter() - T0, 1), stage[-1])
        time.sleep(a.every)
        if time.perf_counter() - last[0] > 60:
            last[0] = time.perf_counter()
            print("TICK", round(last[0] - T0), stage[-1], "rss", round(r), "peak", round(peak[0]), peak[1], "load", os.getloadavg(), flush=True)
stage = ["start"]
threading.Thread(target=sampler, daemon=True).start()

orig_passes = fit._passes
def passes(model, taps, stats, encoded, batches, *args, **kw):
    desc = args[2]
    stage.append(desc)
    mark("pass start " + desc, batches=len(batches))
    peak_live[0] = 0
    r = orig_passes(model, taps, stats, encoded, batches, *args, **kw)
    mark("pass end " + desc, live_peak=round(peak_live[0]))
    stage.pop()
    return r
fit._passes = passes

orig_score = fit._FitStep.score
nb = [0]
def score(self, b):
    r = orig_score(self, b)
    nb[0] += 1
    if stage[-1].startswith("curvature"): mark("batch", n=nb[0], shape=list(b["input_ids"].shape), stage=stage[-1])
    if a.trim_every_batch:
        gradients.release_host_memory()
    return r
fit._FitStep.score = score

from prism_select.curvature import base as _base
from prism_select import pipeline as _pl
from prism_select.methods import prism as _prism
def _wrapstage(owner, name, label):
    f = getattr(owner, name)
    def g(*args, **kw):
        stage.append(label)
        mark(label + " start")
        peak_live[0] = 0
        try:
            return f(*args, **kw)
        finally:
            mark(label + " end", live_peak=round(peak_live[0]))
            stage.pop()
    setattr(owner, name, g)
_wrapstage(_base.Curvature, "precondition", "precondition")
_rh = _base.release_host_memory
trims = []
def _timed_trim():
    t = time.perf_counter(); _rh(); trims.append(time.perf_counter() - t)
_base.release_host_memory = _timed_trim
_wrapstage(_pl, "score_encoded", "scoring")
_wrapstage(_prism, "compute_preference", "target direction")
_wrapstage(_base.Curvature, "save", "curvature save")
orig_fin = fit._finish_lambda
def fin(*args, **kw):
    mark("finish_lambda start")
    r = orig_fin(*args, **kw)
    mark("finish_lambda end")
    if not a.full:
        out()
        os._exit(0)
    return r
fit._finish_lambda = fin

def out():
    if trims: print("TRIMS", len(trims), "total s", round(sum(trims), 3), "max s", round(max(trims), 3))
    print("PEAK", round(peak[0]), peak[1], "live heap peak", round(peak_live[0]), peak_live[1], flush=True)
    if a.json:
        json.dump({"log": log, "peak": peak, "args": vars(a)}, open(a.json, "w"), indent=1)

code = cli.main(["demo", "--out", os.path.join(a.out, f"demo{a.pool}"), "--pool-size", str(a.pool), "--overwrite", "--no-progress"])
out()
