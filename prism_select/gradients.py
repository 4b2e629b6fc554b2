"""Tracked linear layers: per-token inputs ``a_t`` and output gradients ``b_t``.

For a linear layer ``o_t = W a_t (+ bias)``, an example's weight gradient is
``G = sum_t b_t a_t^T`` (``b_t = dl/do_t``). prism-select never stores ``G`` per
candidate when scoring: ``<G, V> = sum_t b_t^T V a_t`` needs only ``a`` and ``b``,
which hooks capture during one forward and one backward *to the activations*
(parameters frozen, so no weight gradient is formed).

A bias is handled as an extra input column of ones, so every layer's gradient is
one ``out x (in [+ 1])`` matrix.
"""

from __future__ import annotations

import contextvars
import ctypes
import ctypes.util
import sys
import tempfile
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch

from .errors import NumericalError
from .model.moe import layer_mask
from .runtime.layers import GRAD32, has_bias, layer_shape, local

def _grad(p: torch.Tensor):
    # the float32 accumulator of precision.float32_grads (--precision split32), else .grad
    return local(getattr(p, GRAD32) if hasattr(p, GRAD32) else p.grad)


def weight_grad(module: torch.nn.Linear) -> torch.Tensor:
    """The layer's accumulated gradient as one ``out x (in [+1])`` matrix: ``.grad``, or
    float32 under :func:`prism_select.runtime.precision.float32_grads`; under FSDP2, this rank's
    rows of it."""
    g = _grad(module.weight)
    if g is None:
        w = local(module.weight)
        return torch.zeros(w.shape[0], layer_shape(module)[1], dtype=w.dtype, device=w.device)
    if has_bias(module):
        gb = _grad(module.bias)
        gb = gb if gb is not None else torch.zeros(g.shape[0], dtype=g.dtype, device=g.device)
        g = torch.cat([g, gb[:, None].to(g.dtype)], dim=1)
    return g


class Taps:
    """Capture ``a`` (inputs, padding zeroed, bias column appended) and ``b``
    (gradients w.r.t. outputs) of tracked layers for one batch at a time."""

    def __init__(self, modules: dict, compute_dtype: torch.dtype = torch.float32):
        self.modules = modules
        self.compute_dtype = compute_dtype
        self.a: dict = {}
        self.b: dict = {}
        self.mask: torch.Tensor | None = None  # (B, T) attention mask of the batch
        self._handles: list = []

    def _fwd(self, name):
        module = self.modules[name]

        def hook(mod, inputs, output):
            a = inputs[0].detach()
            dt = self.compute_dtype if a.dtype in (torch.float16, torch.bfloat16) else a.dtype
            a = a.to(dt)
            # an expert's layer sees its own tokens (prism_select.model.moe): the mask at its slots
            mask = None if self.mask is None else layer_mask(module, self.mask)
            if mask is not None:
                a = a * mask[..., None].to(dt)
            if has_bias(module):
                ones = torch.ones(*a.shape[:-1], 1, dtype=dt, device=a.device)
                if mask is not None:
                    ones = ones * mask[..., None].to(dt)
                a = torch.cat([a, ones], dim=-1)
            self.a[name] = a
            if output.requires_grad:
                def grad_hook(g, name=name):
                    gd = self.compute_dtype if g.dtype in (torch.float16, torch.bfloat16) else g.dtype
                    g = g.detach().to(gd)
                    if mask is not None:
                        g = g * mask[..., None].to(gd)
                    self.b[name] = g
                output.register_hook(grad_hook)
        return hook

    def __enter__(self):
        for name, m in self.modules.items():
            self._handles.append(m.register_forward_hook(self._fwd(name)))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.clear()

    def clear(self):
        self.a.clear()
        self.b.clear()

    def per_example_grads(self, name: str) -> torch.Tensor:
        """``G_n = sum_t b_{n,t} a_{n,t}^T`` for every example of the batch: (B, out, in')."""
        return torch.einsum("bto,bti->boi", self.b[name], self.a[name])


@contextmanager
def activation_grad_mode(model: torch.nn.Module):
    """Freeze every parameter and make the embedding output require grad, so a
    backward pass computes gradients w.r.t. activations only. Restores the
    parameters' ``requires_grad`` flags on exit."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in flags:
        p.requires_grad_(False)
    emb = model.get_input_embeddings()
    handle = emb.register_forward_hook(lambda mod, inp, out: out.requires_grad_(True))
    try:
        yield
    finally:
        handle.remove()
        for p, f in flags:
            p.requires_grad_(f)


@contextmanager
def tracked_param_grad_mode(model: torch.nn.Module, modules: dict):
    """Only the tracked layers' weights (and biases) require grad; grads zeroed."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in flags:
        p.requires_grad_(False)
        p.grad = None
    for m in modules.values():
        m.weight.requires_grad_(True)
        if has_bias(m):
            m.bias.requires_grad_(True)
    try:
        yield
    finally:
        for p, f in flags:
            p.grad = None
            p.requires_grad_(f)


def check_finite(t: torch.Tensor, what: str, layer: str | None = None, record=None):
    """Raise :class:`NumericalError` naming the layer and record if ``t`` has NaN/inf.
    A finite sum means every element is finite (NaN and inf propagate through a sum), so
    the elementwise check (a bool copy of ``t``) runs only when the sum is not finite (a
    NaN, an inf, or an overflowing sum)."""
    if t.is_floating_point() and bool(torch.isfinite(t.sum())):
        return
    if not torch.isfinite(t).all():
        where = []
        if layer is not None:
            where.append(f"layer '{layer}'")
        if record is not None:
            where.append(f"record(s) {record}")
        raise NumericalError(
            f"non-finite values (NaN or inf) in {what}" + (" at " + ", ".join(where) if where else "")
            + "; " + _non_finite_advice())


# The dtype the current run computes in (set by :func:`set_run_dtype` once its model is
# loaded): what :func:`check_finite` advises depends on it.
_RUN_DTYPE: contextvars.ContextVar = contextvars.ContextVar("prism_select_run_dtype", default=None)


def set_run_dtype(dtype: torch.dtype | None) -> None:
    """Record the dtype of the run's model (its weights were found finite at load)."""
    _RUN_DTYPE.set(dtype)


def _non_finite_advice() -> str:
    dtype = _RUN_DTYPE.get()
    if dtype is None:
        return ("if the model computes in float16 or bfloat16, try --dtype float32; otherwise check the record's "
                "text and the model's weights")
    name = str(dtype).replace("torch.", "")
    if dtype in (torch.float16, torch.bfloat16):
        return (f"the run computes in {name}, whose range a long or unusual record can overflow: try --dtype "
                "float32, or check the record's text")
    return (f"the run computes in {name} already and the model's weights are finite (checked at load), so "
            "neither the precision nor the weights is the cause: check the record's text (a record the model "
            "gives a vanishing probability), and the model's outputs on it")


def side_by_side(fn, items, window: int | None = None):
    """``fn(item)`` for each of ``items``, in their order: side by side on as many one-thread
    workers as torch has threads (each worker sets its own thread count; this thread's is
    restored), or here one after the other with one thread or fewer than two items (a
    list). On the CPU, independent eigendecompositions and small GEMMs scale better so than
    over a team of threads. ``window``: at most this many items are taken from ``items``
    (any iterable, read in this thread) and not yet returned, so that a generator that
    reads each item (e.g. a layer of a direction waiting on disk) is not read whole ahead
    of the workers; None: all are submitted at once."""
    threads = torch.get_num_threads()
    sized = hasattr(items, "__len__")
    if threads < 2 or sized and len(items) < 2:
        yield from map(fn, items)
        return
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(min(threads, len(items)) if sized else threads,
                                initializer=torch.set_num_threads, initargs=(1,)) as pool:
            if window is None:
                yield from pool.map(fn, items)
                return
            pending: deque = deque()
            for item in items:
                pending.append(pool.submit(fn, item))
                if len(pending) >= window:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
    finally:
        torch.set_num_threads(threads)


def release_host_memory(device: torch.device | str | None = None) -> None:
    """Hand freed heap memory back to the operating system (glibc's ``malloc_trim``).

    Activations and per-batch products of a few MB each come from the C heap, not from
    their own mappings; once freed they stay in the process's resident memory until the
    heap is trimmed, so a stage that is over (the target direction's graph, a fit pass)
    would keep its high-water mark for the rest of the run: about 1.3 GB after the demo's
    target direction. A no-op where glibc is not the allocator, and where
    ``device`` (the device the freed work ran on) is not the CPU: that work's tensors were
    not on the host heap."""
    if device is not None and torch.device(device).type != "cpu":
        return

    if not sys.platform.startswith("linux"):
        return
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _libc.malloc_trim(0)
    except (OSError, AttributeError):
        _libc = False


_libc = None


def host_peak_mib() -> float | None:
    """The process's resident high-water mark so far, MiB (``ru_maxrss``); None where the
    platform does not report it."""
    import resource

    try:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    except (AttributeError, OSError):
        return None
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes there, KiB on Linux


class SpilledLayers:
    """Layer matrices moved from host memory into an unnamed temporary file (removed when
    closed or collected) and read back one at a time: a read-only mapping with ``pop``,
    which is all :meth:`prism_select.curvature.base.Curvature.precondition` uses.

    ``SpilledLayers(tensors, directory)`` writes every tensor of ``tensors`` (host
    tensors, any dtype) and then empties ``tensors``, so the caller's dict no longer holds
    them: while the curvature is fitted next to it, the direction takes disk, not memory
    (540 MB for the embedded model). Writing raises ``OSError`` (a full disk) before
    anything is removed from ``tensors``. ``pop(name)`` reads a layer back and forgets it;
    ``[name]`` reads it and keeps it on disk."""

    def __init__(self, tensors: dict, directory=None):
        self._f = tempfile.TemporaryFile(dir=directory)
        self._where: dict = {}
        try:
            for n, t in tensors.items():
                t = t.detach().contiguous()
                off = self._f.seek(0, 2)
                self._f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
                self._where[n] = (off, tuple(t.shape), t.dtype)
            self._f.flush()
        except BaseException:
            self._f.close()
            raise
        tensors.clear()

    def __getitem__(self, name) -> torch.Tensor:
        off, shape, dtype = self._where[name]
        t = torch.empty(shape, dtype=dtype)
        self._f.seek(off)
        self._f.readinto(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        return t

    def pop(self, name) -> torch.Tensor:
        t = self[name]
        del self._where[name]
        if not self._where:
            self.close()
        return t

    def __iter__(self):
        return iter(list(self._where))

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, name) -> bool:
        return name in self._where

    def close(self) -> None:
        self._where.clear()
        self._f.close()
