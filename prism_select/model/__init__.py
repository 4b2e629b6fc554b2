"""The model: loading it (a local Hugging Face directory, a GGUF file or the embedded
default; :mod:`.load`, :mod:`.gguf`), its settings (:mod:`.settings`), the linear layers
PRISM tracks (:mod:`.tracking`) and fused experts as per-expert layers (:mod:`.moe`).
The everyday names are importable from here.
"""

from .gguf import (check_gguf_complete, converted_gguf_dir, gguf_cache_key, read_gguf_scalars,
                   resolve_default_gguf)
from .load import (check_adapter_dir, check_finite_weights, check_vocabulary, free_cuda_cache, load_model,
                   model_fingerprint)
from .settings import DEFAULT_MODEL, DTYPES, LoadedModel, ModelSettings, default_cache_dir
from .tracking import tracked_linear_modules

__all__ = ["DEFAULT_MODEL", "DTYPES", "LoadedModel", "ModelSettings", "check_adapter_dir", "check_finite_weights",
           "check_gguf_complete", "check_vocabulary", "converted_gguf_dir", "default_cache_dir", "free_cuda_cache",
           "gguf_cache_key", "load_model", "model_fingerprint", "read_gguf_scalars", "resolve_default_gguf",
           "tracked_linear_modules"]
