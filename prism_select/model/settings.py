"""Which model to load and how (:class:`ModelSettings`), what loading gives
(:class:`LoadedModel`), where converted models are cached, and the installed stack's
versions (recorded with a converted model and in run.json).
"""

from __future__ import annotations

import importlib.metadata
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import ConfigError
from ..settings import setting


DEFAULT_MODEL = "default"
CACHE_ENV = "PRISM_SELECT_CACHE"
DTYPES = ("auto", "bfloat16", "float32", "float64")
_DTYPE_MAP = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}
_DEVICE_RE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")


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
