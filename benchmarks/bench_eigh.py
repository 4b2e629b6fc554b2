"""Time the eigendecompositions of the curvature fit on the current device.

EK-FAC eigendecomposes one symmetric factor per distinct layer input and one per layer
output; at 8B Llama shapes most of the cost is the ~96 factors of size 14336. This
prints a table (size, dtype, backend, seconds, orthogonality and reconstruction error)
and writes JSON.

    python3 benchmarks/bench_eigh.py --sizes 4096 14336 --json out.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def spd(n: int, device, seed: int = 0) -> torch.Tensor:
    """A covariance-like SPD matrix (Gram of 2n random rows with a decaying spectrum)."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(2 * n, n, device=device, generator=g)
    x *= torch.logspace(0, -3, n, device=device)
    return (x.T @ x) / (2 * n)


def run(n: int, dtype, backend: str, device) -> dict:
    M = spd(n, device).to(dtype)
    if device.type == "cuda":
        torch.backends.cuda.preferred_linalg_library(backend)
        torch.cuda.synchronize()
    t = time.perf_counter()
    lam, Q = torch.linalg.eigh(M)
    if device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t
    Md = M.double()
    Qd = Q.double()
    rec = float((Qd @ torch.diag(lam.double()) @ Qd.T - Md).norm() / Md.norm())
    orth = float((Qd.T @ Qd - torch.eye(n, device=device, dtype=torch.float64)).abs().max())
    return {"n": n, "dtype": str(dtype), "backend": backend, "seconds": dt, "rel_reconstruction": rec,
            "max_orthogonality_error": orth}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1536, 4096])
    p.add_argument("--dtypes", nargs="+", default=["float32", "float64"])
    p.add_argument("--backends", nargs="+", default=["cusolver", "magma"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json")
    a = p.parse_args()
    device = torch.device(a.device)
    backends = a.backends if device.type == "cuda" else ["default"]
    rows = []
    run(256, torch.float32, backends[0], device)  # warm-up (library load)
    for n in a.sizes:
        for dt in a.dtypes:
            for b in backends:
                try:
                    r = run(n, getattr(torch, dt), b, device)
                except Exception as exc:  # a backend missing from this build
                    r = {"n": n, "dtype": dt, "backend": b, "error": str(exc)[:200]}
                rows.append(r)
                print(f"{r['n']:>6} {r['dtype']:>14} {r['backend']:>9} "
                      + (f"{r['seconds']:8.2f} s  rec {r['rel_reconstruction']:.1e}  orth {r['max_orthogonality_error']:.1e}"
                         if "seconds" in r else r["error"]), flush=True)
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": dev, "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
