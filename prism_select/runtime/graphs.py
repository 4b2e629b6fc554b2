"""CUDA graphs for the scoring routes and the curvature fit: capture a batch's whole
step (score computation, or fit statistics) once per padded shape, then replay it.

Why: on models up to ~0.5B parameters a scoring step (like a training step) is bound
by the host launching kernels, not by the GPU (docs/performance.md: a 0.3B step at
batch 16 takes ~55 ms for ~20 ms of arithmetic). A CUDA graph replays the recorded
kernels with one launch, so the route runs at the GPU's pace.

How: every batch is padded to ``batch_size`` rows and to a *bucketed* length
(:func:`bucket_length`, at most 1/8 extra tokens, never fewer than 16), so a pool
needs only a few dozen shapes. For each new shape the scorer's ``score`` runs once on
a side stream (warm-up: kernel selection, lazy initialisation), then once under
capture; later batches of that shape copy their tokens into the captured input
buffers and replay. All graphs share one memory pool: the intermediates of one shape
reuse the memory of another, so memory stays at about one step's peak.

Correctness rests on right padding: padded positions come after every real token, so
under causal attention no real token sees them; their labels are ``-100`` (no loss,
and their output gradients are exactly zero). The captured batches carry no
attention mask (``attention_mask=None``, plain causal attention), which is also what
lets the attention run its fused causal kernel. Padded rows score exactly 0 and are
dropped. ``tests/test_graphs.py`` checks graphed against eager scores on the GPU and
the padding/bucketing on the CPU.

``auto`` captures for models below :data:`AUTO_MAX_PARAMS` parameters; the curvature
fit additionally needs enough batches per shape (``curvature.fit.FIT_GRAPH_MIN_REPLAYS``).

If a capture fails (a model whose forward needs the host mid-step, e.g. reading a
tensor's value), the scorer logs why and falls back to eager execution for the rest
of the run; results are unaffected. A shape whose warm-up step reserved more than
1 / :data:`CAPTURE_HEADROOM` of what the process may still reserve
(:func:`prism_select.runtime.memory.device_headroom`) runs eagerly, and the shapes captured before
keep their graphs. That check does not make a capture under a tight memory cap safe: on
one H200 (torch 2.11, 2026-11-29) the embedded model's scoring at batch 32 x 400 tokens
under a 30 GiB cap (``max_gpu_memory``, four processes on the GPU) passed it, its capture
still ran out of the cap with 5.5 GiB in the graphs' pool, and every eager step after it
ran out too (a capture stopped by the allocator keeps its pool for the rest of the
process). The plan does not count the graphs' pool; where a cap is tight, leave the
graphs' room above the plan's peak (65 GiB ran there) or pass ``--cuda-graphs off``. After
a capture ran out of memory, the process's later scorers capture nothing, and an
out-of-memory error names that fix (:func:`capture_out_of_memory`).
"""

from __future__ import annotations

import logging

import torch

from .. import errors as _errors
from ..errors import ConfigError, capture_out_of_memory  # noqa: F401 (re-exported)
from ..settings import GRAPH_MODES, check_graph_mode  # noqa: F401 (re-exported)
from . import memory

log = logging.getLogger(__name__)

#: never pad a batch to fewer than this many tokens of length granularity
MIN_BUCKET = 16
#: extra length allowed by bucketing: ``1 / BUCKET_FRACTION`` of the next power of two
BUCKET_FRACTION = 8
# why a capture in this process ran out of memory, if one did: errors.CAPTURE_OOM (kept
# there, so that errors.resource_error names the fix without importing this module)


#: a shape is captured only where the process may still reserve this many times what its
#: eager warm-up step reserved (a capture's pool holds the step's intermediates apart from
#: the general cache, and cannot give back the memory of a capture that failed)
CAPTURE_HEADROOM = 2.0


def bucket_length(t: int) -> int:
    """Smallest bucket ``>= t``: a multiple of ``max(MIN_BUCKET, 2^ceil(log2 t) / 8)``."""
    if t <= MIN_BUCKET:
        return MIN_BUCKET
    step = max(MIN_BUCKET, (1 << (t - 1).bit_length()) // BUCKET_FRACTION)
    return -(-t // step) * step


def pad_batch(batch: dict, rows: int, length: int, pad_id: int, out: dict | None = None) -> dict:
    """``batch`` (right-padded ``input_ids``/``labels``/``attention_mask``) padded to
    ``rows x length``. The model gets no attention mask (``attention_mask`` None); the
    real-token mask travels as ``token_mask`` for code that counts tokens (the
    curvature fit). Written into ``out``'s buffers when given."""
    ids, labels, mask = batch["input_ids"], batch["labels"], batch.get("attention_mask")
    if mask is None:
        mask = batch["token_mask"]
    b, t = ids.shape
    if out is None:
        out = {"input_ids": torch.full((rows, length), pad_id, dtype=ids.dtype, device=ids.device),
               "labels": torch.full((rows, length), -100, dtype=labels.dtype, device=labels.device),
               "token_mask": torch.zeros((rows, length), dtype=mask.dtype, device=mask.device),
               "attention_mask": None}
    else:
        out["input_ids"].fill_(pad_id)
        out["labels"].fill_(-100)
        out["token_mask"].zero_()
    out["input_ids"][:b, :t].copy_(ids, non_blocking=True)
    out["labels"][:b, :t].copy_(labels, non_blocking=True)
    out["token_mask"][:b, :t].copy_(mask, non_blocking=True)
    return out


#: ``auto`` captures graphs for models below this many parameters: measured on an H200
#: (docs/performance.md), graphs speed a 135M and a 0.3B model's steps 1.2-2.4x
#: (the host's kernel launches bound them) and slow a 1.1B model's by 3-7% (padding,
#: capture), where the GPU is already the bottleneck
AUTO_MAX_PARAMS = 1_000_000_000


def graphs_wanted(mode: str, device, model=None) -> bool:
    """``auto``: on for CUDA devices and models below :data:`AUTO_MAX_PARAMS` parameters,
    off for a model with per-expert layers (a module with a true ``routes_tokens``, as
    :class:`prism_select.model.moe.EagerExperts`: an expert's slots per example change with the
    batch's routing, a shape a graph cannot replay); ``on`` on a
    CPU device, or for such a model, is an error."""
    check_graph_mode(mode)
    is_cuda = torch.device(device).type == "cuda"
    if mode == "on" and not is_cuda:
        raise ConfigError("cuda_graphs", "CUDA graphs need a CUDA device",
                          "pass --cuda-graphs auto (or off) when scoring on the CPU")
    if model is not None and mode != "off" and any(getattr(m, "routes_tokens", False) for m in model.modules()):
        if mode == "on":
            raise ConfigError("cuda_graphs", "a mixture-of-experts model's expert layers take as many token slots "
                              "as the batch routes to each expert, a shape that changes from batch to batch "
                              "(CUDA graphs replay fixed shapes)", "pass --cuda-graphs auto (or off)")
        return False
    if mode == "auto" and is_cuda and model is not None:
        return sum(p.numel() for p in model.parameters()) < AUTO_MAX_PARAMS
    return is_cuda and mode != "off"


class GraphedScorer:
    """Wraps a scorer (an object with ``score(batch) -> (B,)`` and optionally a context
    manager) so that each padded batch shape is captured once and replayed.

    A step that accumulates state (the curvature fit's statistics) must not count its
    warm-up runs: it provides ``neutral(batch)``, a batch of the same shape that adds
    nothing (no labels, no real tokens), used for the warm-up instead.

    ``capture=False`` keeps the padding and bucketing but runs eagerly (used to test the
    padding on the CPU, and as the fallback after a failed capture).
    """

    def __init__(self, scorer, batch_size: int, pad_id: int, capture: bool = True):
        self.inner, self.rows, self.pad_id = scorer, batch_size, pad_id
        self.capture = capture
        self.graphs: dict = {}  # length -> (graph, static batch, static scores)
        self.pool = None
        self.captures = 0
        self.failed: str | None = None
        self.eager: set = set()  # padded lengths whose capture would not fit in memory

    def __enter__(self):
        if hasattr(self.inner, "__enter__"):
            self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        self.graphs.clear()  # frees the graphs' memory pool
        if hasattr(self.inner, "__exit__"):
            self.inner.__exit__(*exc)

    def computed_tokens(self, batch: dict) -> int:
        """Token positions actually computed for ``batch`` (rows and length padded)."""
        return self.rows * bucket_length(batch["input_ids"].shape[1])

    def score(self, batch: dict) -> torch.Tensor:
        b, t = batch["input_ids"].shape
        if b > self.rows:
            raise ValueError(f"batch of {b} rows exceeds the graphed batch size {self.rows}")
        length = bucket_length(t)
        if not self.capture or self.failed or length in self.eager or _errors.CAPTURE_OOM:
            return self.inner.score(pad_batch(batch, self.rows, length, self.pad_id))[:b]
        entry = self.graphs.get(length)
        if entry is None:
            entry = self._capture(batch, length)
            if entry is None:
                return self.inner.score(pad_batch(batch, self.rows, length, self.pad_id))[:b]
        graph, static, out = entry
        pad_batch(batch, self.rows, length, self.pad_id, out=static)
        graph.replay()
        return out[:b].clone()

    def _capture(self, batch: dict, length: int):
        static = pad_batch(batch, self.rows, length, self.pad_id)
        warm = graph = out = None
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            warm = self.inner.neutral(static) if hasattr(self.inner, "neutral") else static
            # the warm-up starts from an empty cache, so what it reserves is its step's memory
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            device = static["input_ids"].device
            before = torch.cuda.memory_reserved(device)
            with torch.cuda.stream(side):
                for _ in range(2 if not self.graphs else 1):  # warm-up: kernel choice, lazy init
                    self.inner.score(warm)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            step = torch.cuda.memory_reserved(device) - before
            # hand the warm-up's cached blocks back first: no block can be freed while a capture
            # runs, so under a memory cap (max_gpu_memory) the capture would otherwise need the
            # step's memory a second time
            torch.cuda.empty_cache()
            room = memory.device_headroom(device)
            if room < CAPTURE_HEADROOM * step:
                self.eager.add(length)
                log.info("length %d runs without a CUDA graph: its step reserved %.2f GiB, the process "
                         "may reserve %.2f GiB more (a capture needs %.1fx)", length, step / 2**30,
                         room / 2**30, CAPTURE_HEADROOM)
                return None
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self.inner.score(static)
        except Exception as exc:  # capture is an optimisation: fall back, keep the run going
            self.failed = _first_error(exc)
            if "out of memory" in self.failed.lower() and not _errors.CAPTURE_OOM:
                _errors.CAPTURE_OOM.append(self.failed)
        else:
            self.captures += 1
            self.graphs[length] = (graph, static, out)
            return self.graphs[length]
        # the failed capture's graph, inputs and memory pool are unreachable now (the exception,
        # whose traceback held this frame, is gone): free the pool before the eager steps need it
        static = warm = graph = out = None
        self.graphs.clear()
        self.pool = None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        log.warning("CUDA graph capture failed (%s); scoring continues without graphs", self.failed)
        return None


def _first_error(exc: BaseException) -> str:
    """``Type: message`` of the error that broke a capture: the last of ``exc``'s chain of
    contexts (a failed capture raises again when its capture context closes)."""
    first = exc
    while first.__context__ is not None:
        first = first.__context__
    return f"{type(first).__name__}: {first}"
