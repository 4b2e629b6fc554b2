"""Loading a model: a local Hugging Face directory, a GGUF file (converted once,
:mod:`prism_select.model.gguf`) or the embedded default, an optional PEFT adapter, the
checks of what was loaded, and the model fingerprint.

Nothing here downloads: every ``from_pretrained`` call is ``local_files_only``.

* HF directory: must hold ``config.json`` and weights (``*.safetensors`` or
  ``pytorch_model*.bin``; safetensors preferred, ``.bin`` only through transformers'
  ``weights_only`` loader) plus tokenizer files. ``trust_remote_code`` is off unless
  asked for.
* GGUF file and ``"default"``: see :mod:`prism_select.model.gguf`.

The model fingerprint (:func:`model_fingerprint`) is a sha256 over the config (less
paths and version fields), the PEFT adapter config if any, and for every parameter
in order its name, shape, dtype, the bytes of its first and last 1024 elements (as
float64) and an exact integer checksum of all its elements' bit patterns. Any change
to a single element changes the checksum, the result does not depend on the device
(integer sums are exact), and the cost is one pass over the weights.
"""

from __future__ import annotations

import gc
import hashlib
import importlib.util
import json
import logging
import re
import warnings
from pathlib import Path

import numpy as np
import torch

from ..errors import ConfigError, ModelError
from ..io import canonical_json
from .gguf import _is_gguf_file, converted_gguf_dir, resolve_default_gguf
from .moe import linearize_model
from .settings import DEFAULT_MODEL, LoadedModel, ModelSettings, _dtype_kwargs, _versions
log = logging.getLogger(__name__)

_SAMPLE = 1024
_CHUNK = 1 << 24  # elements per chunk of the integer checksum (bounds temporary memory)
# Config entries that describe where/how a model was loaded, not what it computes.
_CONFIG_SKIP = {"transformers_version", "dtype", "torch_dtype", "quantization_config",
                "use_cache", "attn_implementation"}


# --------------------------------------------------------------------------- helpers


def _weight_files(d: Path) -> list:
    return sorted(d.glob("*.safetensors")) + sorted(d.glob("pytorch_model*.bin"))


def _check_hf_dir(d: Path) -> None:
    if not d.exists():
        raise ModelError(f"model directory {d} does not exist; pass a local Hugging Face model directory, "
                         "a .gguf file, or 'default'")
    if not d.is_dir():
        raise ModelError(f"{d} is neither a directory nor a .gguf file; pass a local Hugging Face model "
                         "directory (config.json + *.safetensors + tokenizer files), a .gguf file, or 'default'")
    missing = []
    if not (d / "config.json").is_file():
        missing.append("config.json")
    if not _weight_files(d):
        missing.append("weights (*.safetensors or pytorch_model*.bin)")
    if missing:
        present = sorted(p.name for p in d.iterdir())[:12]
        raise ModelError(
            f"model directory {d} lacks {' and '.join(missing)} (it holds: {', '.join(present) or 'nothing'}). "
            "A loadable directory, as written by save_pretrained, holds config.json, model.safetensors "
            "(or model-*.safetensors + model.safetensors.index.json, or pytorch_model*.bin) and the tokenizer "
            "files (tokenizer.json / tokenizer_config.json)")


def _load_tokenizer(path: Path, settings: ModelSettings, what: str):
    from transformers import AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=settings.trust_remote_code,
                                            local_files_only=True)
    except Exception as e:  # transformers raises OSError / ValueError / KeyError here
        raise ModelError(f"cannot load the tokenizer of {what} from {path}: {type(e).__name__}: {e}. "
                         "The directory needs tokenizer.json (or the files of a slow tokenizer) and "
                         "tokenizer_config.json, as written by tokenizer.save_pretrained") from e
    return tok


_warned_templates: set = set()


def _prepare_tokenizer(tok, name: str):
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ModelError(f"the tokenizer of {name} has neither a pad nor an EOS token; "
                             "add one (tokenizer.add_special_tokens) and save it with the model")
        tok.pad_token = tok.eos_token
        warnings.warn(f"the tokenizer of {name} has no pad token; using its EOS token "
                      f"{tok.eos_token!r} for padding", stacklevel=3)
    if not getattr(tok, "chat_template", None) and name not in _warned_templates:
        _warned_templates.add(name)
        warnings.warn(f"the tokenizer of {name} has no chat template; prompts are rendered as plain "
                      "text (prompt + response + EOS)", stacklevel=3)
    tok.padding_side = "right"
    return tok


def _from_pretrained(path: Path, settings: ModelSettings, dtype: torch.dtype, what: str):
    from transformers import AutoModelForCausalLM
    kwargs = dict(trust_remote_code=settings.trust_remote_code, local_files_only=True,
                  output_loading_info=True, **_dtype_kwargs(dtype))
    if settings.attn_implementation:
        kwargs["attn_implementation"] = settings.attn_implementation
    if any(path.glob("*.safetensors")):
        kwargs["use_safetensors"] = True
    try:
        model, info = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    except Exception as e:
        text = str(e)
        hint = ""
        if type(e).__name__ == "UnpicklingError" or "weights_only" in text:
            unsafe = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
            raise ModelError(
                f"cannot load {what} from {path}: its weights are a pickle file (pytorch_model*.bin) that holds "
                f"more than tensors{f' ({unsafe.group(1)})' if unsafe else ''}, and prism-select loads pickles only "
                "with torch's safe loader, which refuses it (loading it unsafely could run any code in the file). "
                "Fix: save the weights as safetensors where you trust the file (model.save_pretrained(dir, "
                "safe_serialization=True)) and pass that directory") from None
        if "trust_remote_code" in text:
            raise ModelError(f"cannot load {what} from {path}: its config names model code of its own (auto_map), "
                             "which is not run by default. Fix: pass --trust-remote-code, only if you trust the "
                             "code in that directory") from None
        elif settings.attn_implementation and any(w in text.lower() for w in ("attn", "attention")):
            raise ConfigError("attn_implementation",
                              f"{settings.attn_implementation!r} cannot be used with {what} here: "
                              f"{type(e).__name__}: {text[:400]}",
                              "use eager or sdpa, or leave it out") from e
        raise ModelError(f"cannot load {what} from {path}: {type(e).__name__}: {text[:800]}{hint}") from e
    missing = sorted(info.get("missing_keys") or [])
    mismatched = sorted(str(k) for k in (info.get("mismatched_keys") or []))
    if missing or mismatched:
        parts = []
        if missing:
            parts.append(f"{len(missing)} weight(s) missing from the files (e.g. {', '.join(missing[:5])})")
        if mismatched:
            parts.append(f"{len(mismatched)} weight(s) of the wrong shape (e.g. {', '.join(mismatched[:5])})")
        raise ModelError(f"{what} at {path} does not match its config: {'; '.join(parts)}; these would be "
                         "randomly initialised. Check that the weights belong to this config.json")
    return model


# --------------------------------------------------------------------------- adapter

def check_adapter_dir(adapter: Path) -> None:
    """:class:`ModelError` unless ``adapter`` is a PEFT adapter directory and peft is
    installed (cheap: checked before the base model loads)."""
    if not adapter.is_dir():
        raise ModelError(f"adapter directory {adapter} does not exist")
    if not (adapter / "adapter_config.json").is_file():
        present = sorted(p.name for p in adapter.iterdir())[:12]
        raise ModelError(f"{adapter} is not a PEFT adapter directory: no adapter_config.json "
                         f"(it holds: {', '.join(present) or 'nothing'}); pass the directory written by "
                         "PeftModel.save_pretrained (adapter_config.json + adapter_model.safetensors)")
    if importlib.util.find_spec("peft") is None:
        raise ModelError("loading an adapter needs the 'peft' package; install it with: pip install 'peft>=0.13'")


def _adapter_targets_parameters(adapter: Path) -> bool:
    """Whether the adapter's config names ``target_parameters`` (PEFT's LoRA on raw
    parameters, e.g. fused experts)."""
    try:
        cfg = json.loads((adapter / "adapter_config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(cfg.get("target_parameters")) if isinstance(cfg, dict) else False


def _load_adapter(base, adapter: Path, base_name: str):
    check_adapter_dir(adapter)
    from peft import PeftModel
    try:
        declared = json.loads((adapter / "adapter_config.json").read_text()).get("base_model_name_or_path")
    except Exception as e:
        raise ModelError(f"adapter {adapter}: adapter_config.json is not valid JSON: {e}") from e
    made_for = f" (it was made for {declared!r})" if declared else ""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            model = PeftModel.from_pretrained(base, str(adapter), is_trainable=True,
                                              autocast_adapter_dtype=False, local_files_only=True)
        except Exception as e:
            raise ModelError(f"the adapter {adapter} does not fit the base model {base_name}{made_for}: "
                             f"{type(e).__name__}: {str(e)[:800]}") from e
    for w in caught:
        msg = str(w.message)
        if "missing adapter keys" in msg or "unexpected" in msg.lower() and "key" in msg.lower():
            raise ModelError(f"the adapter {adapter} does not fit the base model {base_name}{made_for}: {msg[:800]}")
        if not issubclass(w.category, (DeprecationWarning, FutureWarning)):  # library-internal noise
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return model


# --------------------------------------------------------------------------- fingerprint

def _config_dict(model) -> dict:
    cfg = getattr(model, "config", None)
    if cfg is None:
        return {}
    d = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(vars(cfg))
    return {k: v for k, v in d.items() if not k.startswith("_") and k not in _CONFIG_SKIP}


def _bit_checksum(p: torch.Tensor) -> int:
    """Sum of the elements' bit patterns as (wrapping) int64: exact, so the same on
    every device, and changed by any change to any single element."""
    flat = p.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    itype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(flat.element_size())
    if itype is None or flat.is_complex():
        flat = torch.view_as_real(flat) if flat.is_complex() else flat.to(torch.float64)
        flat = flat.reshape(-1).to(torch.float64)
        itype = torch.int64
    bits = flat.contiguous().view(itype)
    if bits.device.type == "cpu":
        # numpy widens and sums in one buffered pass (about 10x torch's sum(dtype=int64) on
        # the CPU: 1.2 CPU-s for the embedded model's 135M weights, a single-threaded
        # part of every run); the exact integer is the same
        return int(bits.numpy().sum(dtype=np.int64)) % (1 << 64)
    total = 0
    for start in range(0, bits.numel(), _CHUNK):
        total += int(bits[start:start + _CHUNK].sum(dtype=torch.int64).item())
    return total % (1 << 64)


def model_fingerprint(model: torch.nn.Module) -> str:
    """sha256 over config, adapter config and a deterministic sample of every parameter.

    Hashed, in order: the config as sorted JSON (without transformers_version, dtype,
    attention implementation and private ``_`` entries: the parameter dtypes are
    hashed below); the PEFT config(s), if any; then per parameter (named_parameters
    order) its name, shape and dtype, its first and last 1024 elements converted to
    float64, and the integer sum of all its elements' bit patterns. Cheap even at 7B
    parameters (one read of each tensor on its own device, no full copies), stable
    across devices and processes, and changed by any single-weight change.
    """
    h = hashlib.sha256()
    h.update(canonical_json(_config_dict(model)).encode())
    peft_config = getattr(model, "peft_config", None)
    if peft_config:
        pc = {name: (c.to_dict() if hasattr(c, "to_dict") else str(c)) for name, c in peft_config.items()}
        for c in pc.values():
            if isinstance(c, dict):
                c.pop("base_model_name_or_path", None)
                c.pop("revision", None)
                c.pop("inference_mode", None)
        h.update(canonical_json(pc).encode())
    with torch.no_grad():
        for name, p in model.named_parameters():
            h.update(f"{name}|{tuple(p.shape)}|{p.dtype}|".encode())
            flat = p.detach().reshape(-1)
            n = flat.numel()
            head = flat[: min(_SAMPLE, n)]
            tail = flat[max(n - _SAMPLE, 0):]
            h.update(head.to("cpu", torch.float64).numpy().tobytes())
            h.update(tail.to("cpu", torch.float64).numpy().tobytes())
            h.update(str(_bit_checksum(p)).encode())
    return h.hexdigest()


# --------------------------------------------------------------------------- load

def load_model(settings: ModelSettings, *, host: bool = False) -> LoadedModel:
    """Load model + tokenizer (+ adapter) as ``settings`` say; see the module docstring.
    ``host``: keep the weights in host memory, in the dtype the device would get (for
    :func:`prism_select.runtime.sharding.shard_model`, which moves each rank's shard there)."""
    if not isinstance(settings, ModelSettings):
        raise ConfigError("model", f"expected ModelSettings, got {type(settings).__name__}")
    device = settings.resolved_device()
    dtype = settings.resolved_dtype(device)
    source: dict = {"model": settings.model, "adapter": None, "gguf_file": None, "gguf_key": None,
                    "converted_path": None}

    spec = settings.model
    if spec == DEFAULT_MODEL:
        gguf_path = resolve_default_gguf().resolve()
        source["kind"] = "default"
    elif spec.lower().endswith(".gguf") or _is_gguf_file(Path(spec).expanduser()):
        gguf_path = Path(spec).expanduser().resolve()
        if not gguf_path.is_file():
            raise ModelError(f"GGUF file {gguf_path} does not exist")
        source["kind"] = "gguf"
    else:
        gguf_path = None
        source["kind"] = "hf_dir"

    if gguf_path is not None:
        load_dir = converted_gguf_dir(gguf_path, settings.resolved_cache_dir())
        source.update(path=str(gguf_path), gguf_file=gguf_path.name, gguf_key=load_dir.name,
                      converted_path=str(load_dir))
        what = f"the converted GGUF model {gguf_path.name}"
        name = str(gguf_path)
    else:
        load_dir = Path(spec).expanduser().resolve()
        _check_hf_dir(load_dir)
        source["path"] = str(load_dir)
        what = "the model"
        name = str(load_dir)

    model = _from_pretrained(load_dir, settings, dtype, what)
    tokenizer = _prepare_tokenizer(_load_tokenizer(load_dir, settings, what), name)

    adapter = Path(settings.adapter).expanduser().resolve() if settings.adapter is not None else None
    if adapter is not None and _adapter_targets_parameters(adapter):
        # PEFT's LoRA on fused expert parameters addresses them by name: they stay fused
        source["linearized"] = {"skipped": "the adapter targets parameters (target_parameters)"}
    else:
        source["linearized"] = linearize_model(model)
    if adapter is not None:
        model = _load_adapter(model, adapter, name)
        source["adapter"] = str(adapter)

    model = model.to(device="cpu" if host else device, dtype=dtype)
    model.eval()
    check_vocabulary(model, tokenizer, name)
    check_finite_weights(model, name)
    source.update(dtype=str(dtype).replace("torch.", ""), device=str(device), versions=_versions())
    return LoadedModel(model=model, tokenizer=tokenizer, settings=settings,
                       fingerprint=model_fingerprint(model), source=source)


def check_vocabulary(model: torch.nn.Module, tokenizer, name: str) -> None:
    """A :class:`ModelError` when the tokenizer can give ids that the model's embedding
    has no row for (``len(tokenizer)`` tokens, ids ``0 .. len - 1``): the first forward
    over such an id would fail with an ``IndexError`` deep inside the model."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(getattr(emb, "weight", None), "shape", (None,))[0]
    n = len(tokenizer) if hasattr(tokenizer, "__len__") else None
    if rows is not None and n is not None and n > rows:
        raise ModelError(f"the tokenizer of {name} has {n} tokens but the model's embedding has {rows} rows: "
                         f"ids {rows} to {n - 1} have no embedding (the tokenizer belongs to another model, or "
                         "tokens were added without resizing the embeddings); load the tokenizer saved with "
                         "these weights, or resize the embeddings (model.resize_token_embeddings) and save again")


def check_finite_weights(model: torch.nn.Module, name: str) -> None:
    """A :class:`ModelError` naming the tensors of ``model`` that hold a NaN or an inf
    (weights saved after a diverged training, or a damaged file): no score computed
    from them could be finite. A tensor whose sum is finite has only finite elements
    (NaN and inf propagate through a sum); only the others are checked element by element."""
    bad = []
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.is_floating_point() and not bool(torch.isfinite(p.sum())) and not bool(torch.isfinite(p).all()):
                bad.append(n)
    if bad:
        raise ModelError(f"the weights of {name} hold non-finite values (NaN or inf) in {len(bad)} tensor(s), "
                         f"e.g. {', '.join(bad[:3])}: the checkpoint is damaged or was saved after its training "
                         "diverged; load an earlier or re-downloaded checkpoint")


def free_cuda_cache():
    """Return cached GPU memory between steps (a no-op on CPU)."""
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
