"""Evaluating a selection: LoRA fine-tuning on a subset and exporting it for other trainers."""

from ..export import export_subset
from ..finetune import (FinetuneResult, FinetuneSettings, finetune, load_optimizer_state,
                       save_optimizer_state)

__all__ = ["FinetuneResult", "FinetuneSettings", "finetune", "export_subset",
           "load_optimizer_state", "save_optimizer_state"]
