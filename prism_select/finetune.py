"""LoRA supervised fine-tuning with a response-only loss (``transformers.Trainer`` + ``peft``).

Used to evaluate a selected subset (the paper's App. E settings, through
:meth:`FinetuneSettings.preset`) and by LESS for its warm-up training.

* Data: a pool file (any format :func:`prism_select.data.load_pool` reads), a list of
  :class:`~prism_select.data.PoolExample`, or already encoded
  :class:`~prism_select.data.tokenize.Encoded` examples. Examples are encoded with
  :func:`prism_select.data.tokenize.encode` (chat template, prompt cut from the left)
  and batched by :func:`~prism_select.data.tokenize.collate`, whose ``labels`` are -100
  off the response: the loss is the response tokens' cross-entropy only. The model
  computes it; with gradient accumulation ``Trainer`` averages over all response tokens
  of the accumulated micro-batches (its ``num_items_in_batch`` normalisation), as
  LLaMA-Factory does.
* Model: a :class:`~prism_select.model.LoadedModel` (trained in place: the LoRA
  layers are injected into it and removed again afterwards, so the caller's base
  model comes back unchanged, in eval mode) or :class:`~prism_select.model.ModelSettings`
  (loaded here). A model that already carries an adapter is refused.
* Outputs in ``out_dir``: ``adapter/`` (``adapter_config.json`` +
  ``adapter_model.safetensors``; load it with ``ModelSettings(model=..., adapter=...)``),
  ``finetune.json`` (settings, per-step log, learning rates, counts, versions) and,
  with ``save_every_epoch``, ``checkpoints/epoch-<k>/`` holding the adapter at the end
  of epoch ``k``, ``optimizer.safetensors`` and ``checkpoint.json``.

``optimizer.safetensors`` holds Adam's state of every LoRA parameter as plain tensors,
so nothing has to be unpickled later: ``exp_avg.<name>`` (first moment ``m``) and
``exp_avg_sq.<name>`` (second moment ``v``), where ``<name>`` is the parameter's key in
``adapter_model.safetensors`` (e.g. ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``).
Its metadata records ``step``, ``betas`` and ``eps`` (JSON strings).
``checkpoint.json`` records the epoch, the global step, the learning rate of each
optimizer step of the epoch and their mean (``mean_lr``; LESS weights checkpoints by it).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import math
import os
import shutil
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .data import load_pool
from .data.records import PoolExample
from .data.tokenize import Encoded, collate, encode
from .errors import ConfigError, InputError, OutputError
from .io import atomic_write_json, check_writable_dir
from .model import LoadedModel, ModelSettings, load_model
from .model.tracking import _is_peft
from .settings import check_seed

log = logging.getLogger(__name__)

ATTENTION_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]
OPTIMIZER_FILE = "optimizer.safetensors"
CHECKPOINT_FILE = "checkpoint.json"
SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup", "cosine_with_restarts", "polynomial")


@dataclass
class FinetuneSettings:
    """LoRA SFT settings. Defaults = the paper's general-selection run (App. E, Table
    ``tab:repro-hparams``), which follows LESS (Xia et al. 2024).

    learning_rate, epochs, batch_size (per device), grad_accum: optimisation
        (effective batch = batch_size x grad_accum on one device).
    lora_r, lora_alpha, lora_dropout: the LoRA adapter.
    target_modules: module-name suffixes LoRA wraps (``q_proj`` ...), or ``"all-linear"``
        (every linear layer but the output head, PEFT's shorthand).
    lr_scheduler: a ``transformers`` scheduler name (linear = linear decay to 0).
    warmup_ratio: fraction of the optimizer steps of linear warm-up, in [0, 1).
    weight_decay, max_grad_norm, adam_beta1, adam_beta2, adam_epsilon: AdamW.
    max_length: tokens per example (longer prompts are cut from the left).
    max_steps: stop after this many optimizer steps (-1: run all epochs).
    seed: seeds LoRA initialisation, shuffling and dropout.
    gradient_checkpointing: trade compute for memory.
    skip_invalid: skip examples whose response cannot fit instead of stopping.
    logging_steps: log the loss every this many optimizer steps.
    progress: show progress bars.
    """

    learning_rate: float = 2e-5
    epochs: float = 4
    batch_size: int = 1
    grad_accum: int = 128
    lora_r: int = 128
    lora_alpha: float = 512
    lora_dropout: float = 0.1
    target_modules: list | str = field(default_factory=lambda: list(ATTENTION_MODULES))
    lr_scheduler: str = "linear"
    warmup_ratio: float = 0.03
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_length: int = 2048
    max_steps: int = -1
    seed: int = 0
    gradient_checkpointing: bool = False
    skip_invalid: bool = False
    logging_steps: int = field(default=1, metadata={"key": False})  # not in a trained adapter's key
    progress: bool = field(default=True, metadata={"key": False})

    def __post_init__(self):
        def positive(name, integer=False):
            v = getattr(self, name)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 and math.isfinite(v)
            if integer:
                ok = ok and float(v).is_integer()
            if not ok:
                raise ConfigError(name, f"must be a positive {'integer' if integer else 'number'}, got {v!r}")
            if integer:
                setattr(self, name, int(v))

        check_seed(self.seed)
        for n in ("learning_rate", "epochs", "lora_alpha", "adam_epsilon"):
            positive(n)
        for n in ("batch_size", "grad_accum", "lora_r", "max_length", "logging_steps"):
            positive(n, integer=True)
        if not (0 <= self.lora_dropout < 1):
            raise ConfigError("lora_dropout", f"must be in [0, 1), got {self.lora_dropout!r}")
        if not (0 <= self.warmup_ratio < 1):
            raise ConfigError("warmup_ratio", f"must be in [0, 1), got {self.warmup_ratio!r}")
        if self.weight_decay < 0:
            raise ConfigError("weight_decay", f"must be >= 0, got {self.weight_decay!r}")
        if self.lr_scheduler not in SCHEDULERS:
            raise ConfigError("lr_scheduler", f"unknown scheduler {self.lr_scheduler!r}",
                              f"use one of {', '.join(SCHEDULERS)}")
        if not isinstance(self.max_steps, int) or (self.max_steps < 1 and self.max_steps != -1):
            raise ConfigError("max_steps", f"must be a positive integer or -1, got {self.max_steps!r}")
        tm = self.target_modules
        if isinstance(tm, tuple):
            tm = self.target_modules = list(tm)
        if not (tm == "all-linear" or (isinstance(tm, list) and tm and all(isinstance(t, str) and t for t in tm))):
            raise ConfigError("target_modules", f"must be a non-empty list of module names or 'all-linear', got {tm!r}",
                              "e.g. ['q_proj', 'k_proj', 'v_proj', 'o_proj']")

    @classmethod
    def preset(cls, name: str, **overrides) -> "FinetuneSettings":
        """The paper's App. E settings; ``overrides`` replace single fields.

        ``general`` (general-capability selection, after LESS): lr 2e-5, 4 epochs,
        batch 1 x grad-accum 128, LoRA r 128 / alpha 512 / dropout 0.1 on q/k/v/o,
        linear decay with 3% warm-up, weight decay 0, max length 2048. (The table does
        not give dropout, scheduler or warm-up; these are LESS's values, whose setup the
        general-selection experiment follows.)

        ``repair`` (reverse repair): lr 1e-4, 1 epoch, batch 4 x grad-accum 1, LoRA r 32 /
        alpha 64 (LLaMA-Factory's default 2r) on all linear layers, weight decay 0, max
        length 2048; dropout 0, linear schedule without warm-up: LLaMA-Factory's /
        ``transformers``' defaults, since the table gives none.
        """
        presets = {
            "general": dict(learning_rate=2e-5, epochs=4, batch_size=1, grad_accum=128, lora_r=128,
                            lora_alpha=512, lora_dropout=0.1, target_modules=list(ATTENTION_MODULES),
                            lr_scheduler="linear", warmup_ratio=0.03, weight_decay=0.0, max_length=2048),
            "repair": dict(learning_rate=1e-4, epochs=1, batch_size=4, grad_accum=1, lora_r=32,
                           lora_alpha=64, lora_dropout=0.0, target_modules="all-linear",
                           lr_scheduler="linear", warmup_ratio=0.0, weight_decay=0.0, max_length=2048),
        }
        if name not in presets:
            raise ConfigError("preset", f"unknown preset {name!r}", f"use one of {', '.join(presets)}")
        known = {f.name for f in dataclasses.fields(cls)}
        bad = sorted(set(overrides) - known)
        if bad:
            raise ConfigError("preset", f"unknown setting(s) {', '.join(bad)}", f"use fields of {cls.__name__}")
        return cls(**{**presets[name], **overrides})


@dataclass
class FinetuneResult:
    """adapter_dir: the final adapter; checkpoints: per-epoch checkpoint dirs (with
    ``save_every_epoch``); log_history: ``Trainer``'s log (loss, learning_rate, ...);
    epoch_lrs: the learning rates of each epoch's optimizer steps; n_examples: trained on."""

    adapter_dir: Path
    checkpoints: list
    log_history: list
    epoch_lrs: list = field(default_factory=list)
    n_examples: int = 0
    skipped: list = field(default_factory=list)


# --------------------------------------------------------------------------- data

def _encode_examples(tokenizer, data, settings: FinetuneSettings) -> tuple[list, list]:
    path = None
    if isinstance(data, (str, os.PathLike)):
        path = data
        items = load_pool(data, skip_invalid=settings.skip_invalid).items
    else:
        items = list(data)
    encoded, skipped = [], []
    for it in items:
        if isinstance(it, Encoded):
            encoded.append(it)
        elif isinstance(it, PoolExample):
            try:
                encoded.append(encode(tokenizer, it.prompt, it.response, settings.max_length,
                                      path=path, row=it.row, field="response"))
            except InputError as e:
                if not settings.skip_invalid:
                    raise
                skipped.append({"id": it.id, "row": it.row, "reason": e.reason})
        else:
            raise ConfigError("pool", f"expected a pool path, PoolExample or Encoded items, got {type(it).__name__}")
    if not encoded:
        raise InputError("no example to train on", path=path)
    return encoded, skipped


class _EncodedDataset(torch.utils.data.Dataset):
    def __init__(self, encoded):
        self.encoded = encoded

    def __len__(self):
        return len(self.encoded)

    def __getitem__(self, i):
        e = self.encoded[i]
        return {"input_ids": e.input_ids, "response_start": e.response_start}


class _Collator:
    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, features):
        return collate([Encoded(f["input_ids"], f["response_start"]) for f in features], self.pad_id)


# --------------------------------------------------------------------------- checkpoints

def adapter_param_key(param_name: str, adapter_name: str = "default") -> str:
    """``...lora_A.default.weight`` -> ``...lora_A.weight`` (the key PEFT saves it under)."""
    return param_name.replace(f".{adapter_name}.", ".")


def save_optimizer_state(path, model, optimizer, adapter_name: str = "default") -> None:
    """Write Adam's ``exp_avg`` / ``exp_avg_sq`` of every trainable parameter of ``model``
    to ``path`` (safetensors, keyed by :func:`adapter_param_key`)."""
    opt = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps the torch optimizer
    state = opt.state
    tensors, step = {}, 0
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        key = adapter_param_key(name, adapter_name)
        st = state.get(p, {})
        for moment in ("exp_avg", "exp_avg_sq"):
            t = st.get(moment)
            t = torch.zeros_like(p, dtype=torch.float32) if t is None else t
            tensors[f"{moment}.{key}"] = t.detach().to("cpu").contiguous().clone()
        if "step" in st:
            step = max(step, int(float(st["step"])))
    group = opt.param_groups[0]
    meta = {"format": "prism-select-adam-1", "step": str(step),
            "betas": json.dumps([float(b) for b in group.get("betas", (0.9, 0.999))]),
            "eps": json.dumps(float(group.get("eps", 1e-8)))}
    tmp = Path(path).with_name(f".{Path(path).name}.tmp")
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, path)


def load_optimizer_state(checkpoint_dir) -> tuple[dict, dict, dict]:
    """``(exp_avg, exp_avg_sq, metadata)`` from ``checkpoint_dir/optimizer.safetensors``;
    the dicts map adapter parameter keys to tensors. :class:`InputError` if missing."""
    path = Path(checkpoint_dir) / OPTIMIZER_FILE
    if not path.is_file():
        raise InputError(f"no {OPTIMIZER_FILE} (Adam state) in this checkpoint", path=checkpoint_dir,
                         fix=f"use checkpoints written by prism_select.finetune(save_every_epoch=True), "
                             f"or add {OPTIMIZER_FILE} with tensors 'exp_avg.<param key>' and "
                             "'exp_avg_sq.<param key>' (keys as in adapter_model.safetensors)")
    m, v = {}, {}
    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata() or {})
        for k in f.keys():
            if k.startswith("exp_avg_sq."):
                v[k[len("exp_avg_sq."):]] = f.get_tensor(k)
            elif k.startswith("exp_avg."):
                m[k[len("exp_avg."):]] = f.get_tensor(k)
    return m, v, meta


def _save_checkpoint(directory: Path, model, optimizer, info: dict) -> None:
    tmp = directory.with_name(f".{directory.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(str(tmp))
    if optimizer is not None:
        save_optimizer_state(tmp / OPTIMIZER_FILE, model, optimizer)
    atomic_write_json(tmp / CHECKPOINT_FILE, info)
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(tmp, directory)


def _make_callback(out_dir: Path, save_every_epoch: bool, record: dict):
    from transformers import TrainerCallback

    class _Epochs(TrainerCallback):
        def on_epoch_begin(self, args, state, control, **kw):
            record["epoch_lrs"].append([])

        def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kw):
            if optimizer is not None:
                if not record["epoch_lrs"]:
                    record["epoch_lrs"].append([])
                record["epoch_lrs"][-1].append(float(optimizer.param_groups[0]["lr"]))

        def on_epoch_end(self, args, state, control, model=None, optimizer=None, **kw):
            if not save_every_epoch:
                return
            k = len(record["epoch_lrs"])
            lrs = record["epoch_lrs"][-1] if record["epoch_lrs"] else []
            d = out_dir / "checkpoints" / f"epoch-{k}"
            _save_checkpoint(d, model, optimizer, {
                "epoch": k, "global_step": int(state.global_step), "lrs": lrs,
                "mean_lr": (sum(lrs) / len(lrs)) if lrs else 0.0})
            record["checkpoints"].append(d)

    return _Epochs()


# --------------------------------------------------------------------------- training

def _training_args(settings: FinetuneSettings, out_dir: Path, device: torch.device, dtype: torch.dtype):
    from transformers import TrainingArguments

    fields = {f.name: f for f in dataclasses.fields(TrainingArguments)}
    kw = dict(
        output_dir=str(out_dir / "trainer"), per_device_train_batch_size=settings.batch_size,
        gradient_accumulation_steps=settings.grad_accum, learning_rate=settings.learning_rate,
        num_train_epochs=settings.epochs, max_steps=settings.max_steps, lr_scheduler_type=settings.lr_scheduler,
        weight_decay=settings.weight_decay, max_grad_norm=settings.max_grad_norm, adam_beta1=settings.adam_beta1,
        adam_beta2=settings.adam_beta2, adam_epsilon=settings.adam_epsilon, optim="adamw_torch",
        seed=settings.seed, data_seed=settings.seed, logging_steps=settings.logging_steps,
        logging_strategy="steps", save_strategy="no", report_to="none", remove_unused_columns=False,
        disable_tqdm=not settings.progress, dataloader_num_workers=0,
        bf16=dtype == torch.bfloat16, use_cpu=device.type == "cpu",
    )
    # transformers 5.x takes a warm-up fraction as a float warmup_steps < 1; 4.x has warmup_ratio.
    if "warmup_ratio" in fields:
        kw["warmup_ratio"] = settings.warmup_ratio
    else:
        kw["warmup_steps"] = settings.warmup_ratio
    if settings.gradient_checkpointing:  # renamed activation_checkpointing in later 5.x releases
        name = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
        kw[name] = True
        kw[f"{name}_kwargs"] = {"use_reentrant": False}
    args = TrainingArguments(**{k: v for k, v in kw.items() if k in fields})
    if device.type == "cuda" and args.n_gpu > 1:
        # Outside a distributed launch, Trainer wraps the model in nn.DataParallel over every
        # visible GPU, which multiplies the batch by their number: an SFT's batch and step
        # count must not depend on the machine, so it trains on its model's one device.
        args._n_gpu = 1
    return args


def finetune(model, pool, out_dir, settings: FinetuneSettings | None = None, save_every_epoch: bool = False,
             *, overwrite: bool = False) -> FinetuneResult:
    """Train a LoRA adapter on ``pool`` with a response-only loss; see the module docstring.

    model: :class:`LoadedModel` (trained in place, restored afterwards) or :class:`ModelSettings`.
    pool: a pool file path, or a list of PoolExample / Encoded.
    out_dir: receives ``adapter/``, ``finetune.json`` and (``save_every_epoch``) ``checkpoints/``.
    overwrite: replace an existing ``adapter/`` (otherwise :class:`OutputError`).
    """
    for pkg, pin in (("peft", "peft>=0.13"), ("accelerate", "accelerate>=1.0")):
        if importlib.util.find_spec(pkg) is None:
            raise ConfigError("finetune", f"fine-tuning needs the {pkg!r} package",
                              f"pip install '{pin}' (or: pip install 'prism-select[eval]')")
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, set_seed

    settings = settings or FinetuneSettings()
    out_dir = check_writable_dir(Path(out_dir))
    adapter_dir = out_dir / "adapter"
    if adapter_dir.exists() and not overwrite:
        raise OutputError(f"{adapter_dir} already exists; pass overwrite=True or choose another out_dir")
    if isinstance(model, ModelSettings):
        lm = load_model(model)
    elif isinstance(model, LoadedModel):
        lm = model
    else:
        raise ConfigError("model", f"expected LoadedModel or ModelSettings, got {type(model).__name__}")
    base = lm.model
    if _is_peft(base):
        raise ConfigError("model", "the model already carries a PEFT adapter",
                          "fine-tune from the base model (or merge the adapter into it first)")
    t0 = time.perf_counter()
    encoded, skipped = _encode_examples(lm.tokenizer, pool, settings)
    device, dtype = lm.device, lm.dtype
    flags = [(p, p.requires_grad) for p in base.parameters()]
    was_training = base.training
    ckpt_before = _checkpointing(base)
    emb = base.get_input_embeddings()
    emb_hooks = set(emb._forward_hooks) if emb is not None else set()
    set_seed(settings.seed)
    cfg = LoraConfig(r=settings.lora_r, lora_alpha=settings.lora_alpha, lora_dropout=settings.lora_dropout,
                     target_modules=settings.target_modules, bias="none", task_type="CAUSAL_LM")
    try:
        with warnings.catch_warnings():  # peft reads transformers' deprecated is_gradient_checkpointing
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            peft_model = get_peft_model(base, cfg)
    except ValueError as e:
        raise ConfigError("target_modules", f"{settings.target_modules!r} does not fit this model: {e}",
                          "name the model's linear layers (e.g. q_proj) or use 'all-linear'") from e
    record = {"epoch_lrs": [], "checkpoints": []}
    if save_every_epoch:
        shutil.rmtree(out_dir / "checkpoints", ignore_errors=True)
    try:
        if settings.gradient_checkpointing:
            peft_model.enable_input_require_grads()
        trainer = Trainer(model=peft_model, args=_training_args(settings, out_dir, device, dtype),
                          train_dataset=_EncodedDataset(encoded), data_collator=_Collator(lm.tokenizer.pad_token_id),
                          callbacks=[_make_callback(out_dir, save_every_epoch, record)])
        trainer.train()
        log_history = list(trainer.state.log_history)
        tmp = out_dir / ".adapter.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        peft_model.save_pretrained(str(tmp))
        shutil.rmtree(adapter_dir, ignore_errors=True)
        os.replace(tmp, adapter_dir)
    finally:
        restored = peft_model.unload()
        if restored is not base:  # unload returns the same object; keep the caller's reference valid
            log.warning("peft unload returned a different model object")
        for p, f in flags:
            p.requires_grad_(f)
            p.grad = None
        base.train(was_training)
        if emb is not None:  # hooks added for checkpointing (enable_input_require_grads)
            for k in [k for k in emb._forward_hooks if k not in emb_hooks]:
                del emb._forward_hooks[k]
        if settings.gradient_checkpointing:
            if not ckpt_before:
                off = getattr(base, "activation_checkpointing_disable", None) or \
                    getattr(base, "gradient_checkpointing_disable", None)
                if off is not None:
                    off()
        shutil.rmtree(out_dir / "trainer", ignore_errors=True)
    epoch_lrs = [lrs for lrs in record["epoch_lrs"] if lrs]
    result = FinetuneResult(adapter_dir=adapter_dir, checkpoints=list(record["checkpoints"]),
                            log_history=log_history, epoch_lrs=epoch_lrs, n_examples=len(encoded),
                            skipped=skipped)
    import transformers
    atomic_write_json(out_dir / "finetune.json", {
        "settings": asdict(settings), "model": dict(lm.source), "model_fingerprint": lm.fingerprint,
        "n_examples": len(encoded), "skipped": skipped, "adapter_dir": str(adapter_dir),
        "checkpoints": [str(c) for c in result.checkpoints], "epoch_lrs": epoch_lrs,
        "log_history": log_history, "seconds": round(time.perf_counter() - t0, 3),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "peft": _peft_version()}})
    return result


def _checkpointing(model) -> bool:
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # renamed in transformers 5.x
        if hasattr(type(model), name) or name in dir(model):
            try:
                return bool(getattr(model, name))
            except Exception:
                continue
    return False


def _peft_version() -> str | None:
    try:
        import peft
        return peft.__version__
    except Exception:
        return None
