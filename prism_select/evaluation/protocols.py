"""The paper's evaluation protocols (Sec. 3, App. B and E), small enough to run here.

Three protocols, each a function of a validated config (:mod:`.sections`) that writes an
experiment directory (:mod:`.experiment`) and returns its results:

``ranking(config, out)``  :mod:`.ranking`: AUROC and AUPRC of the harmful flag of
    GSM8K mistake-math pools, for every method, harmful ratio and target variant.
``repair(config, out)``  :mod:`.repair`: target pairs from probes that got worse after
    SFT, removal of each method's top records, SFT again, probe error rate.
``select(config, out)``  :mod:`.general_selection`: SFT on each method's top fraction
    of a pool, accuracy on held-out probes per task.

:func:`run_experiment` loads a config (YAML or JSON; see :func:`.config.load_config`)
and runs one of them; it is what ``prism-select experiment`` calls.
"""

from __future__ import annotations

from ..errors import ConfigError
from .config import PROTOCOLS, load_config
from .sections import (BBHConfig, CommonConfig, FinetuneConfig, GenerationConfig, MistakeMathConfig, ProbeConfig,
                       RankingConfig, RepairConfig, SelectConfig, TargetVariant)
from .general_selection import select
from .ranking import ranking
from .repair import repair

__all__ = ["PROTOCOLS", "RUNNERS", "BBHConfig", "CommonConfig", "FinetuneConfig", "GenerationConfig",
           "MistakeMathConfig", "ProbeConfig", "RankingConfig", "RepairConfig", "SelectConfig",
           "TargetVariant", "load_config", "ranking", "repair", "select", "run_experiment"]

RUNNERS = {"ranking": ranking, "repair": repair, "select": select}


def run_experiment(protocol: str, config_source, out_dir, *, seeds=None, smoke: bool = False,
                   data_root=None, overwrite: bool = False, jobs: int = 1, target_tasks=None,
                   harmful_ratios=None) -> dict:
    """Load and validate the config, then run ``protocol``; returns results.json's content.
    ``jobs``: worker processes for the repair protocol's retrainings; ``target_tasks``:
    the target tasks a multitask select run selects for (``multitask.select_for``);
    ``harmful_ratios``: a ranking or repair run's ratios instead of the config's."""
    if jobs < 1 or (jobs > 1 and protocol != "repair"):
        raise ConfigError("jobs", f"{jobs} worker processes: they run the repair protocol's retrainings, "
                          "at least 1", f"leave --jobs out for {protocol!r}" if protocol != "repair"
                          else "pass --jobs 1 or more")
    cfg = load_config(config_source, protocol, smoke=smoke, seeds=seeds, data_root=data_root,
                      target_tasks=target_tasks, harmful_ratios=harmful_ratios)
    if protocol == "repair":
        return repair(cfg, out_dir, overwrite=overwrite, jobs=jobs)
    return RUNNERS[protocol](cfg, out_dir, overwrite=overwrite)
