"""Host memory of using a saved curvature once: load, damping, and ``H^-1 g`` of one
direction with the caller's last use (``precondition(consume=True, release=True)``), as
every gradient method after the first does in `compare`. Side by side in one run, each
mode in a fresh process:

* ``files``: the library's load (:class:`prism_select.curvature.base.HostTensorFiles`:
  each tensor read from the file when used);
* ``whole``: every tensor read into memory at load (what ``Curvature.load`` did before).

    python benchmarks/curvature_load_rss.py CURVATURE_DIR [--json out.json] [--threads 2]

``CURVATURE_DIR`` is a cache entry (``curvature.json`` + ``factors.safetensors``), e.g.
``<cache>/curvature/<key>`` after a `score`. The direction is random, float32, of each
layer's shape. Prints a table (RSS before the load, high-water mark, wall seconds) and
writes ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = ("files", "whole")


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _child(directory: str, mode: str, threads: int) -> dict:
    import torch

    from prism_select.curvature.base import Curvature, PreconditionSettings
    from prism_select.curvature.base import apply_damping
    from prism_select.gradients import release_host_memory

    from safetensors import safe_open

    torch.set_num_threads(threads)
    meta = json.loads((Path(directory) / "curvature.json").read_text())
    dims: dict = {}  # layer -> {QS: out, QA: in} or {D: (out, in)}
    for f in meta.get("files", ["factors.safetensors"]):  # the headers only: no tensor is read
        with safe_open(str(Path(directory) / f), "pt") as so:
            for k in so.keys():
                name, part = k.split("::")
                if part in ("QS", "QA", "D"):
                    dims.setdefault(name, {})[part] = so.get_slice(k).get_shape()
    shapes = {n: tuple(d["D"]) if "D" in d else (d["QS"][0], d["QA"][0]) for n, d in dims.items()}
    g = torch.Generator().manual_seed(0)
    direction = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    release_host_memory()
    before = _status_mib("VmRSS")
    t = time.perf_counter()
    cur = Curvature.load(directory)
    if mode == "whole":
        cur.tensors = {k: cur.tensors[k] for k in cur.tensors}
    after_load = _status_mib("VmRSS")
    cur = apply_damping(cur, PreconditionSettings())
    v = cur.precondition(direction, consume=True, release=True)
    wall = time.perf_counter() - t
    return {"mode": mode, "layers": len(v), "threads": threads,
            "direction_mib": sum(x.numel() * 4 for x in v.values()) / 2 ** 20,
            "rss_before_load_mib": round(before, 1), "rss_after_load_mib": round(after_load, 1),
            "peak_rss_mib": round(_status_mib("VmHWM"), 1), "wall_s": round(wall, 2)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("directory")
    ap.add_argument("--json", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", choices=MODES, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(_child(a.directory, a.child, a.threads)))
        return
    rows = []
    for mode in MODES:
        out = subprocess.run([sys.executable, __file__, a.directory, "--child", mode, "--threads", str(a.threads)],
                             check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    print(f"{'mode':<6} {'before load MiB':>16} {'after load MiB':>15} {'peak MiB':>9} {'over before':>12} {'wall s':>7}")
    for r in rows:
        print(f"{r['mode']:<6} {r['rss_before_load_mib']:>16.0f} {r['rss_after_load_mib']:>15.0f} "
              f"{r['peak_rss_mib']:>9.0f} {r['peak_rss_mib'] - r['rss_before_load_mib']:>12.0f} {r['wall_s']:>7.1f}")
    if a.json:
        import torch
        Path(a.json).write_text(json.dumps({"directory": a.directory, "torch": torch.__version__,
                                            "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                                            "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
