"""The eigendecompositions of the Kronecker factors: one solver call per factor, and a
schedule that decomposes the narrow CPU factors side by side on one thread each and the
CUDA factors of one width side by side on their own streams."""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from ..runtime import memory

log = logging.getLogger(__name__)

#: CPU eigendecompositions of factors up to this size run on one thread unless OpenMP
#: threads wait passively (``OMP_WAIT_POLICY=PASSIVE``, which the CLI sets before torch
#: loads). LAPACK's divide-and-conquer synchronises its threads at every column of the
#: tridiagonal reduction; spinning threads on a machine whose cores are busy with other
#: work stall each other. Measured on a shared 2-core machine, 1536 x 1536 float32:
#: spinning, 2.7-25 s with 2 threads vs 0.5 s with 1 (load average 3); passive, 0.40-0.50 s
#: with 2 vs 0.56-0.62 s with 1 (load 1.5) and equal under load. Larger factors gain
#: more from threads and keep them.
EIGH_SERIAL_MAX = 2048


def _eigh(M: torch.Tensor):
    """Eigendecomposition of a symmetric factor in the factor's own precision (float32
    unless the model is float64), several times faster than float64 on CUDA and about
    twice as fast on the CPU; float64 if the solver fails or returns non-finite values.
    Only the lower triangle of ``M`` is read (LAPACK's ``uplo='L'``): a factor summed
    by :func:`_gram_into` need not be mirrored first.
    On the CPU a factor up to EIGH_SERIAL_MAX wide is decomposed on one thread, unless
    OpenMP waits passively."""
    threads = torch.get_num_threads()
    serial = (M.device.type == "cpu" and M.shape[0] <= EIGH_SERIAL_MAX and threads > 1
              and os.environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE")
    if serial:
        torch.set_num_threads(1)
    try:
        if M.dtype != torch.float64:
            try:
                lam, Q = torch.linalg.eigh(M)  # uplo="L", the default
                if torch.isfinite(lam.sum()) and torch.isfinite(Q.sum()):  # finite sums: all finite
                    return lam, Q
                why = "non-finite eigenpairs"
            except RuntimeError as e:
                why = f"{type(e).__name__}: {e}"
            log.info("a %d-wide %s factor on %s is decomposed in float64 (%s)", M.shape[0], M.dtype, M.device, why)
        return torch.linalg.eigh(M.double())
    finally:
        if serial:
            torch.set_num_threads(threads)


def _eigh_many(factor, indices: list):
    """Yield ``(i, _eigh(factor(i)))`` for every ``i`` in ``indices`` (in any order).

    On the CPU with several threads the factors up to EIGH_SERIAL_MAX wide are decomposed
    side by side, one factor per thread, each on one thread: LAPACK's symmetric
    eigensolver scales poorly over threads at these sizes (its tridiagonal reduction is
    memory-bound and synchronises at every column), while independent factors scale
    fully. The results are those of a one-thread ``_eigh``. Wider CPU factors run one
    after the other with all threads; CUDA factors of one width run side by side on their
    own streams (:func:`_eigh_cuda_side_by_side`) when CUDA_EIGH_STREAMS allows more than one."""
    threads = torch.get_num_threads()
    small = [i for i in indices if factor(i).device.type == "cpu" and factor(i).shape[0] <= EIGH_SERIAL_MAX]
    if threads < 2 or len(small) < 2:
        small = []
    rest = [i for i in indices if i not in set(small)]
    if small:
        torch.set_num_threads(1)
        try:
            with ThreadPoolExecutor(min(threads, len(small))) as pool:
                yield from zip(small, pool.map(lambda i: _eigh(factor(i)), small))
        finally:
            torch.set_num_threads(threads)
    gpu = [i for i in rest if factor(i).device.type == "cuda"]  # before the caller frees any factor
    for i in rest:
        if factor(i).device.type != "cuda":
            yield i, _eigh(factor(i))
    yield from _eigh_cuda_side_by_side(factor, gpu)


#: CUDA factors decomposed side by side at most, each from its own thread on its own stream
#: (cuSOLVER's divide and conquer leaves much of a large GPU idle). Alone, 4 float32 factors
#: 14336 wide take 1.128 s each side by side against 1.668 s one after another (one H200,
#: 2026-11-28, benchmarks/results/eigh_routes_h200.json); inside the 8B fit the phase took
#: 202.2 s with 4 against 204.1 s with 1 (H200, 2026-11-29), its window then sized by the
#: driver's free memory alone (the bound is :func:`prism_select.runtime.memory.allocatable_bytes`
#: since). Not timed inside a fit since, so off: 1, one after another (docs/scale.md,
#: "Eigendecompositions").
CUDA_EIGH_STREAMS = 1
#: the share of the device's free memory the side-by-side solvers' workspaces may take
CUDA_EIGH_FREE_SHARE = 0.5


def cuda_side_by_side(n: int, itemsize: int, free_bytes: int) -> int:
    """How many ``n``-wide factors to decompose at once: at most CUDA_EIGH_STREAMS, and
    as many as CUDA_EIGH_FREE_SHARE of ``free_bytes`` holds at about three ``n x n``
    matrices each (the eigenvectors and cuSOLVER's workspace); at least 1."""
    each = 3 * n * n * itemsize
    return max(1, min(CUDA_EIGH_STREAMS, int(free_bytes * CUDA_EIGH_FREE_SHARE) // each))


_LINALG_READY: set = set()


def _init_cuda_linalg(device: torch.device) -> None:
    """torch sets up its CUDA linear algebra on the first solver call of the process; that
    set-up may run once only, and side threads that make their first calls at the same time
    race for it (all but one raise). One tiny decomposition on the caller's thread first."""
    if device not in _LINALG_READY:
        torch.linalg.eigh(torch.eye(2, device=device))
        _LINALG_READY.add(device)


def _eigh_cuda_side_by_side(factor, indices: list):
    """Yield ``(i, _eigh(factor(i)))`` for CUDA factors, widest first, up to
    :func:`cuda_side_by_side` factors of one width at a time, each from its own thread on
    its own stream (the same solver on the same matrix: the results of one after
    another). Each side stream first waits for the caller's stream (where the factor was
    summed); the results are marked as used by the caller's stream, which reads and frees
    them."""
    def one(i, caller):
        M = factor(i)
        # a new thread has no current device of its own: cuSOLVER's handle is made for the
        # factor's (pytorch/pytorch#60892: eigh failed on a GPU that was not set)
        torch.cuda.set_device(M.device)
        stream = torch.cuda.Stream(M.device)
        stream.wait_stream(caller)
        with torch.cuda.stream(stream):
            lam, Q = _eigh(M)
        stream.synchronize()
        for t in (lam, Q):  # freed later on the caller's stream: the allocator waits for it
            t.record_stream(caller)
        return lam, Q

    order = sorted(indices, key=lambda i: -factor(i).shape[0])
    k = 0
    while k < len(order):
        M = factor(order[k])
        width = cuda_side_by_side(M.shape[0], M.element_size(), memory.allocatable_bytes(M.device))
        window = [order[k]]
        while len(window) < width and k + len(window) < len(order) \
                and factor(order[k + len(window)]).shape[0] == M.shape[0]:
            window.append(order[k + len(window)])
        k += len(window)
        if CUDA_EIGH_STREAMS > 1:
            log.debug("%d factor(s) %d wide decomposed side by side", len(window), M.shape[0])
        if len(window) == 1:
            yield window[0], _eigh(M)
            continue
        _init_cuda_linalg(M.device)
        caller = torch.cuda.current_stream(M.device)
        with ThreadPoolExecutor(len(window)) as pool:
            yield from zip(window, pool.map(lambda i: one(i, caller), window))
