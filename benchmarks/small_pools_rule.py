"""The small-pool rule against identity and EK-FAC, on every small_pools.py pool measured.

Reads result files of ``benchmarks/small_pools.py`` and prints, for every pool of fewer
than ``--below`` records (the library's SMALL_FIT_EXAMPLES) and for the pools at or above
it, the AUROC of identity curvature, of EK-FAC at each damping of the split-half ladder
(x1 to x1000 the heuristic's 0.1 x mean eigenvalue), of the library's default rule (below
the threshold: identity, so its column equals identity's by construction; from it: plain
EK-FAC) and each curvature's difference to identity, marking (``!``) a difference below
``-BOUND``. ``--held-out FILE...`` marks the pools of those files as held out (measured
after the rule was fixed). Pools are taken once per (device, family, size, ratio, seed);
the first file listed wins.

    python benchmarks/small_pools_rule.py benchmarks/results/small_pools_*.json \\
        --held-out benchmarks/results/small_pools_rule_cpu_heldout60.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

#: the bound the rule is held to: never more than this far below identity
BOUND = 0.02
#: the columns: EK-FAC at the ladder's damping factors (x the heuristic's)
LADDER = {"ekfac": "EK-FAC", "ekfac damping x10": "x10", "ekfac damping x100": "x100",
          "ekfac damping x1000": "x1000"}


def _rows(paths: list, held_out: set) -> list:
    seen, out = set(), []
    for p in paths:
        res = json.loads(Path(p).read_text())
        dev = "cpu" if res.get("device") == "cpu" else str(res.get("device", "?")).replace("NVIDIA ", "")
        for r in res.get("runs", []):
            key = (dev, r["family"], r["n"], r.get("ratio", res.get("ratio")), r["seed"])
            if key in seen or "identity" not in r["auroc"] or "ekfac" not in r["auroc"]:
                continue
            seen.add(key)
            out.append({"key": key, "auroc": r["auroc"], "held_out": str(Path(p).resolve()) in held_out,
                        "file": Path(p).name})
    return sorted(out, key=lambda r: (r["key"][2], r["key"][1], r["key"][3], r["key"][0], r["key"][4]))


def _cell(x, ident) -> str:
    if x is None:
        return "-"
    d = x - ident
    return f"{x:.3f} ({d:+.3f}{' !' if d < -BOUND else ''})"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="+")
    ap.add_argument("--held-out", nargs="*", default=[])
    ap.add_argument("--below", type=int, default=300, help="the rule's threshold (SMALL_FIT_EXAMPLES)")
    a = ap.parse_args()
    held = {str(Path(p).resolve()) for p in a.held_out}
    rows = _rows(a.json + [p for p in a.held_out if p not in a.json], held)
    print(f"AUROC of the harmful flag; in brackets the difference to identity (`!`: more than {BOUND} below). "
          f"The rule: identity below {a.below} fit examples, plain EK-FAC from {a.below} on.\n")
    print("| pool | device | seed | held out | identity | rule | " + " | ".join(LADDER.values()) + " |")
    print("|---|---|---|---|---|---|" + "---|" * len(LADDER))
    worst = {k: 0.0 for k in ["rule", *LADDER]}
    for r in rows:
        dev, fam, n, ratio, seed = r["key"]
        au = r["auroc"]
        ident = au["identity"]
        rule = ident if n < a.below else au["ekfac"]
        cells = [_cell(rule, ident)] + [_cell(au.get(k), ident) for k in LADDER]
        for k, x in [("rule", rule), *((k, au.get(k)) for k in LADDER)]:
            if x is not None:
                worst[k] = min(worst[k], x - ident)
        print(f"| {fam}, {n} ({ratio:g} harmful) | {dev} | {seed} | {'yes' if r['held_out'] else 'no'} | "
              f"{ident:.3f} | " + " | ".join(cells) + " |")
    print("\nLargest shortfall against identity over these pools: "
          + ", ".join(f"{LADDER.get(k, k)} {v:+.3f}" for k, v in worst.items()))


if __name__ == "__main__":
    main()
