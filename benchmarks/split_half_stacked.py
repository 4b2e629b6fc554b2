"""The split-half check with its ladder's directions scored together against one by one.

`--damping-rule split-half` scores a sample of the fit examples with each half's ``v`` at
every factor of the damping ladder (2 x 4 directions). Stacked, the eight directions are
scored from one forward and backward a batch (`scoring.score_directions`); one by one, each
direction costs a whole pass. This runs `prism-select score` on the embedded model twice
on the same pool and targets (the demo's generated arithmetic, or any files), each way in
its own process with one curvature cache: first one by one with the cache cold (it fits the
run's curvature and the check's two halves), then stacked and one by one again with the
fits cached, as a second method on the same pool runs. It reports the check's time
(`split_half_s` of run.json), its agreements and choice, and whether the scores are equal.

    python benchmarks/split_half_stacked.py --n-pool 60 --json out.json [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from prism_select import cli
from prism_select.curvature import support
from prism_select.examples import make_example


def one_run(pool: Path, targets: Path, out: Path, stacked: bool, device: str) -> dict:
    if not stacked:
        support.STACKED_LADDER_MAX_ELEMENTS = 0
    t = time.perf_counter()
    rc = cli.main(["score", "--model", "default", "--pool", str(pool), "--targets", str(targets), "--out", str(out),
                   "--damping-rule", "split-half", "--cache-dir", str(out.parent / "cache"),
                   "--device", device, "--no-progress"])
    wall = time.perf_counter() - t
    if rc != 0:
        raise SystemExit(f"prism-select score exited {rc}")
    run = json.loads((out / "run.json").read_text())
    scores = {json.loads(x)["id"]: json.loads(x)["score"] for x in (out / "scores.jsonl").read_text().splitlines()}
    return {"stacked": stacked, "wall_s": round(wall, 2), "split_half_s": round(run["timings"]["split_half_s"], 2),
            "split_half": run["curvature"]["split_half"], "scores": scores}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n-pool", type=int, default=60, help="records of the generated pool (with --pool: ignored)")
    ap.add_argument("--pool")
    ap.add_argument("--targets")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--json")
    ap.add_argument("--one", choices=["stacked", "walked"], help=argparse.SUPPRESS)  # a child process's run
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.one:  # each way in its own process: neither warms the other's caches
        res = one_run(Path(a.pool), Path(a.targets), Path(a.out), a.one == "stacked", a.device)
        Path(a.out, "bench.json").write_text(json.dumps(res))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if a.pool:
            pool, targets = Path(a.pool), Path(a.targets)
        else:
            pool, targets = make_example(tmp / "data", n_pool=a.n_pool)
        rows = []
        for name, way in (("cold, one by one", "walked"), ("cached, stacked", "stacked"),
                          ("cached, one by one", "walked")):
            out = tmp / f"run{len(rows)}"
            subprocess.run([sys.executable, __file__, "--one", way, "--pool", str(pool), "--targets", str(targets),
                            "--out", str(out), "--device", a.device], check=True)
            rows.append({"run": name, **json.loads((out / "bench.json").read_text())})
    same = all(r["scores"] == rows[0]["scores"] for r in rows)
    for r in rows:
        print(f"{r['run']:>20}: split-half check {r['split_half_s']} s (whole run {r['wall_s']} s); "
              f"factor {r['split_half']['damping_factor']}; agreements {r['split_half']['agreement']}")
    print(f"scores equal in the three runs: {same}")
    if a.json:
        Path(a.json).write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d"), "machine": platform.machine(), "processor": platform.processor(),
            "n_pool": a.n_pool if not a.pool else None, "device": a.device, "scores_equal": same,
            "runs": [{k: v for k, v in r.items() if k != "scores"} for r in rows]}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
