"""Routes for many same-size eigendecompositions on one GPU, side by side.

EK-FAC at the 8B Llama shape eigendecomposes about 96 factors of size 14336 (``down_proj``
inputs, ``gate``/``up`` outputs) one after another. This times, for ``K`` factors of one
size: one after another in float64 and in float32; ``K`` at once from ``K`` threads on
their own CUDA streams (cuSOLVER's ``syevd`` leaves much of a large GPU idle in its
tridiagonal reduction); one batched call on the stacked ``K`` matrices. Every route's
eigenpairs are checked: the relative residual ``||Q diag(l) Q^T - M|| / ||M||`` and
``||Q^T Q - I||`` in float64.

    python3 benchmarks/eigh_routes.py --sizes 4096 14336 --k 4 --json out.json
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import torch


def spd(n: int, device, seed: int) -> torch.Tensor:
    """A covariance-like SPD matrix (Gram of 2n random rows with a decaying spectrum)."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(2 * n, n, device=device, generator=g)
    x *= torch.logspace(0, -3, n, device=device)
    return (x.T @ x) / (2 * n)


def check(M: torch.Tensor, lam: torch.Tensor, Q: torch.Tensor) -> dict:
    Md, Qd = M.double(), Q.double()
    rec = float(((Qd * lam.double()) @ Qd.T - Md).norm() / Md.norm())
    orth = float((Qd.T @ Qd - torch.eye(Qd.shape[0], device=Qd.device, dtype=torch.float64)).norm())
    return {"residual": rec, "orthogonality": orth}


def timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def routes(n: int, k: int, device) -> list:
    mats = [spd(n, device, s) for s in range(k)]
    out = []
    torch.linalg.eigh(mats[0][:64, :64])  # cuSOLVER handle and workspace
    for dtype in (torch.float64, torch.float32):
        res = [None] * k
        ms = [m.to(dtype) for m in mats]

        def seq():
            for i, m in enumerate(ms):
                res[i] = torch.linalg.eigh(m)
        dt = timed(seq)
        out.append({"route": f"sequential {str(dtype)[6:]}", "n": n, "k": k, "seconds_each": dt / k,
                    **check(mats[0], *res[0])})
    ms = [m.clone() for m in mats]
    res = [None] * k

    errors = [None] * k

    def one(i):
        try:
            torch.cuda.set_device(device)
            s = torch.cuda.Stream(device)
            with torch.cuda.stream(s):
                res[i] = torch.linalg.eigh(ms[i])
            s.synchronize()
        except Exception as e:  # noqa: BLE001 (a thread's error is reported, not lost)
            errors[i] = f"{type(e).__name__}: {e}"

    def threads():
        ts = [threading.Thread(target=one, args=(i,)) for i in range(k)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    dt = timed(threads)
    # every thread's result is checked: a failed solve would otherwise only look fast
    checks = [check(mats[i], *res[i]) for i in range(k) if res[i] is not None]
    out.append({"route": f"{k} streams float32", "n": n, "k": k, "seconds_each": dt / k,
                "failed": [e for e in errors if e], "dtypes": sorted({str(r[0].dtype) for r in res if r}),
                **({key: max(c[key] for c in checks) for key in checks[0]} if checks else {})})
    stacked = torch.stack(mats)
    box = {}
    dt = timed(lambda: box.setdefault("r", torch.linalg.eigh(stacked)))
    lam, Q = box["r"]
    out.append({"route": "batched float32", "n": n, "k": k, "seconds_each": dt / k, **check(mats[0], lam[0], Q[0])})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 14336])
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--json")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    dev = torch.device("cuda", torch.cuda.current_device())
    rows = []
    for n in a.sizes:
        for r in routes(n, a.k, dev):
            rows.append(r)
            print(f"{r['n']:>6} {r['route']:<22} {r['seconds_each']:8.3f} s each  residual {r['residual']:.1e}  "
                  f"orthogonality {r['orthogonality']:.1e}", flush=True)
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(info, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
