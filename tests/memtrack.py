"""Bytes of live tensors on the CPU, as a GPU's caching allocator would count them.

:class:`LiveBytes` is a ``TorchDispatchMode`` that records the storage of every tensor
an operator returns while it is active, and forgets it when the storage is freed (a
weak-reference finalizer on the storage). Storages that existed before (the model's
weights) are not counted, nor are those :meth:`LiveBytes.to_host` marks as moved to host
memory (on the CPU ``.to("cpu")`` is the tensor itself). ``peak`` is the largest sum seen;
:meth:`phase` starts a named phase whose own peak is kept in ``phases``.

Used by tests/integration/test_scale.py to compare a fit's device memory with the memory plan's
figure on the same shapes, without a GPU.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    def __init__(self, existing=()):
        super().__init__()
        self.live: dict = {}  # storage data_ptr -> bytes
        self.host: set = set()  # data_ptrs moved to the host (not device bytes)
        self.skip = {t.untyped_storage().data_ptr() for t in existing}
        self.now = 0
        self.peak = 0
        self.phases: dict = {}
        self._phase = None

    # -- accounting
    def _add(self, t: torch.Tensor):
        st = t.untyped_storage()
        ptr, n = st.data_ptr(), st.nbytes()
        if n == 0 or ptr in self.live or ptr in self.skip:
            return
        self.live[ptr] = n
        self.now += n
        weakref.finalize(st, self._free, ptr)
        self._bump()

    def _free(self, ptr):
        n = self.live.pop(ptr, 0)
        if ptr in self.host:
            self.host.discard(ptr)
        else:
            self.now -= n

    def _bump(self):
        self.peak = max(self.peak, self.now)
        if self._phase is not None:
            self.phases[self._phase] = max(self.phases.get(self._phase, 0), self.now)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as if moved to host memory: its bytes leave the device count."""
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.live and ptr not in self.host:
            self.host.add(ptr)
            self.now -= self.live[ptr]
        return t

    def phase(self, name: str):
        self._phase = name
        self.phases[name] = max(self.phases.get(name, 0), self.now)

    # -- dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._add(t)
        return out
