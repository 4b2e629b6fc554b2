"""The Triton kernels of the engine, each compiled on first use (CUDA only).

``split_kernel``   the hi/lo split of a float32 matrix into ``[hi | lo]`` half-precision
                   halves in one pass (:func:`prism_select.engine.arith.split_cat`).
``rowdot_kernel``  per-row dot products of two half-precision matrices, float32
                   accumulation (:func:`prism_select.engine.arith.rowdot`, backend ``triton``).
"""

from __future__ import annotations


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


_split_kernel = None


def split_kernel():
    global _split_kernel
    if _split_kernel is None:
        import triton
        import triton.language as tl

        @triton.jit
        def _split(X, OUT, total, K, BLOCK: tl.constexpr):
            offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            m = offs < total
            x = tl.load(X + offs, mask=m)
            hi = x.to(OUT.dtype.element_ty)
            lo = (x - hi.to(tl.float32)).to(OUT.dtype.element_ty)
            at = (offs // K) * (2 * K) + offs % K
            tl.store(OUT + at, hi, mask=m)
            tl.store(OUT + at + K, lo, mask=m)

        _split_kernel = _split
    return _split_kernel


_rowdot_kernel = None


def rowdot_kernel():
    global _rowdot_kernel
    if _rowdot_kernel is None:
        import triton
        import triton.language as tl

        @triton.jit
        def _rowdot(G, U, OUT, N, K, BLOCK_K: tl.constexpr, ROWS: tl.constexpr):
            pid = tl.program_id(0)
            rows = pid * ROWS + tl.arange(0, ROWS)
            rmask = rows < N
            acc = tl.zeros([ROWS], dtype=tl.float32)
            base = rows.to(tl.int64)[:, None] * K
            for k0 in range(0, K, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)
                m = rmask[:, None] & (cols[None, :] < K)
                g = tl.load(G + base + cols[None, :], mask=m, other=0.0).to(tl.float32)
                u = tl.load(U + base + cols[None, :], mask=m, other=0.0).to(tl.float32)
                acc += tl.sum(g * u, axis=1)
            tl.store(OUT + rows, acc, mask=rmask)

        _rowdot_kernel = _rowdot
    return _rowdot_kernel
