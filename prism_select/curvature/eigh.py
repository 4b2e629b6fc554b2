"""The eigendecompositions of the Kronecker factors: one solver call per factor, and a
schedule that decomposes the narrow CPU factors side by side on one thread each."""

from __future__ import annotations

import torch


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
    import os

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
            except RuntimeError:
                pass
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
    fully. The results are those of a one-thread ``_eigh``. Wider factors, and every
    factor on other devices, run one after the other with all threads."""
    from concurrent.futures import ThreadPoolExecutor

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
    for i in rest:
        yield i, _eigh(factor(i))
