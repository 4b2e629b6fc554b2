"""Run one `prism-select` command with the fit's CUDA eigendecompositions of one width
decomposed ``--streams`` at a time, each from its own thread on its own CUDA stream
(``prism_select.curvature.eigh.CUDA_EIGH_STREAMS``; 1 = one after another).

Two runs of the same `score` command, one per setting, then `benchmarks/dist_report.py`
compares them: each run's fit phases (``run.json``: factors / eigendecompositions /
eigenvalues) and the agreement of the scores (Spearman, largest difference).

    CUDA_VISIBLE_DEVICES=0 python3 benchmarks/eigh_streams.py --streams 1 -- score --model M --out /tmp/r1 ...
    CUDA_VISIBLE_DEVICES=1 python3 benchmarks/eigh_streams.py --streams 4 -- score --model M --out /tmp/r4 ...
    python3 benchmarks/dist_report.py /tmp/r1 /tmp/r4 --json eigh_streams.json
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the CLI does, before torch loads
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, required=True, help="CUDA factors of one width decomposed at once")
    ap.add_argument("argv", nargs="+", help="the prism-select command line (after --)")
    a = ap.parse_args()
    if a.streams < 1:
        ap.error("--streams must be 1 or more")
    from prism_select import cli
    from prism_select.curvature import eigh

    eigh.CUDA_EIGH_STREAMS = a.streams
    return cli.main(a.argv)


if __name__ == "__main__":
    sys.exit(main())
