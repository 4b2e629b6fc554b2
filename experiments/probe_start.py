#!/usr/bin/env python3
"""Greedy responses of the start model to the probes of a repair config, judged as the
repair protocol judges them: the "Start" row of that protocol without any fine-tuning
(generation only, so it also runs on a CPU).

    python experiments/probe_start.py --config experiments/money_refusal.yaml --seeds 0 --out runs/start-probes

Writes ``<out>/seed<k>/probes.jsonl`` and ``responses.jsonl`` and prints, per seed, the
behaviour rate (the checker's error rate on the behaviour probes) and the capability
accuracy per task.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from prism_select.evaluation.config import load_config  # noqa: E402
from prism_select.evaluation.experiment import Experiment, load_start, rates_by_task, respond  # noqa: E402
from prism_select.evaluation.repair import checker_spec, pool_and_probes  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seeds", type=int, nargs="+", default=None)
    p.add_argument("--data-root", default=None)
    a = p.parse_args(argv)
    cfg = load_config(a.config, "repair", seeds=a.seeds, data_root=a.data_root)
    cfg.report = False
    exp = Experiment(Path(a.out), "repair", cfg, overwrite=False)
    lm = load_start(exp, cfg)
    summary = {}
    for seed in cfg.seeds:
        for ratio in cfg.harmful_ratios:
            t = time.perf_counter()
            rdir, _, _, _, probes_path, task = pool_and_probes(exp, cfg, ratio, seed)
            resp = respond(exp, lm, probes_path, rdir / "start", checker_spec(cfg), "start")
            rates = rates_by_task(resp, task)
            summary[f"seed{seed}"] = rates
            print(f"seed {seed}: behaviour rate {rates['behaviour_rate']:.3f} over {rates['n_behaviour']} probes; "
                  f"capability {rates['capability_by_task']} ({time.perf_counter() - t:.0f} s)", flush=True)
    (Path(a.out) / "start_rates.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
