"""A start model made by a clean warm-up SFT: the embedded model answers in its own
words, so a testbed whose probes need a format and a competence first teaches them on
clean records of the family; the LoRA is merged into the weights and the merged model
saved as a model directory, which every later step (scoring, SFT, probes) loads as
its start model.

Layout under the experiment directory::

    start-model/warmup.jsonl     the warm-up records
    start-model/sft/             the warm-up adapter (finetune.json: its settings and loss)
    start-model/model/           config.json, model.safetensors, tokenizer files
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import asdict

from filelock import FileLock

from ..io import sha256_file, write_if_changed
from ..model import free_cuda_cache, load_model
from . import carry, verdict
from .config import config_to_dict
from .sections import finetune_settings
from ..finetune import finetune

log = logging.getLogger(__name__)


def warm_start_settings(exp, cfg):
    """The :class:`~prism_select.model.ModelSettings` of the warmed-up start model of
    ``cfg`` (fine-tuned, merged and saved on first use; reused while its inputs hold)."""
    base = exp.out / "start-model"
    base.mkdir(parents=True, exist_ok=True)
    records_path = base / "warmup.jsonl"
    if getattr(getattr(cfg, "data", None), "family", None) == "carry_verdict":  # (a select config has no data)
        records = verdict.warmup_records(cfg.warmup.n_records)
    else:
        records = carry.warmup_records(cfg.warmup.n_records, cfg.warmup.carry_share)
    write_if_changed(records_path, records)
    settings = finetune_settings(cfg.warmup.finetune, 0)
    key = {"records": sha256_file(records_path), "model": config_to_dict(cfg.model), "finetune": asdict(settings)}
    model_dir = base / "model"
    # runs of other seeds started side by side wait for the first to finish the warm-up
    with FileLock(str(base / ".warmup.lock")):
        if not exp.done(base, key, ["model/config.json", "model/model.safetensors"], "warmup-step"):
            _warm_up(exp, cfg, records_path, settings, model_dir, key)
    return dataclasses.replace(cfg.model, model=str(model_dir))


def _warm_up(exp, cfg, records_path, settings, model_dir, key) -> None:
    """Fine-tune the configured model on the warm-up records, merge, save to ``model_dir``."""
    from peft import PeftModel

    base = model_dir.parent
    t = time.perf_counter()
    log.info("warm-up SFT of the start model on %s", records_path)
    lm = load_model(cfg.model)
    res = finetune(lm, records_path, base / "sft", settings, overwrite=True)
    merged = PeftModel.from_pretrained(lm.model, str(res.adapter_dir)).merge_and_unload()
    merged.save_pretrained(str(model_dir), safe_serialization=True)
    lm.tokenizer.save_pretrained(str(model_dir))
    exp.time("warmup", time.perf_counter() - t)
    exp.finish(base, key, "warmup-step")
    del lm, merged
    free_cuda_cache()
