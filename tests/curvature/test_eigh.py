"""The curvature factors' eigendecomposition (`curvature.eigh._eigh`) on the CPU."""

import pytest
import torch

from prism_select.curvature import eigh as eigh_mod
from prism_select.runtime.memory import allocatable_bytes
from prism_select.gradients import side_by_side

EIGH32_RTOL = 1e-4  # float32 eigenvalues of a well-scaled factor, relative to the largest
EIGH64_ATOL = 1e-12  # float64 eigenvalues and reconstruction, relative to the largest eigenvalue


def _factor(n, dtype, seed=0):
    X = torch.randn(3 * n, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (X.T @ X / (3 * n)).to(dtype)


def test_float32_factor_is_decomposed_in_float32_like_float64():
    M = _factor(96, torch.float32)
    lam, Q = eigh_mod._eigh(M)
    assert lam.dtype == Q.dtype == torch.float32
    ref, _ = torch.linalg.eigh(M.double())
    assert torch.allclose(lam.double(), ref, rtol=0, atol=EIGH32_RTOL * float(ref.max()))
    recon = (Q.double() * lam.double()) @ Q.double().T
    assert torch.allclose(recon, M.double(), atol=EIGH32_RTOL * float(ref.max()))
    assert eigh_mod._eigh(_factor(8, torch.float64))[0].dtype == torch.float64  # float64 models stay float64


@pytest.mark.parametrize("failure", ["raises", "nan"])
def test_float64_fallback(monkeypatch, failure):
    real = torch.linalg.eigh

    def eigh(M):
        if M.dtype == torch.float32:
            if failure == "raises":
                raise torch.linalg.LinAlgError("did not converge")
            lam, Q = real(M)
            return lam * float("nan"), Q
        return real(M)
    monkeypatch.setattr(torch.linalg, "eigh", eigh)
    M = _factor(16, torch.float32)
    lam, Q = eigh_mod._eigh(M)
    assert lam.dtype == Q.dtype == torch.float64
    ref, _ = real(M.double())  # the float64 decomposition of the same factor
    assert torch.allclose(lam, ref, rtol=0, atol=EIGH64_ATOL * float(ref.max()))
    assert torch.allclose((Q * lam) @ Q.T, M.double(), rtol=0, atol=EIGH64_ATOL * float(ref.max()))


def test_small_factors_run_on_one_thread_and_the_setting_is_restored(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    seen, real = [], torch.linalg.eigh
    monkeypatch.setattr(torch.linalg, "eigh", lambda M: (seen.append(torch.get_num_threads()), real(M))[1])
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        eigh_mod._eigh(_factor(16, torch.float32))
        monkeypatch.setattr(eigh_mod, "EIGH_SERIAL_MAX", 8)
        eigh_mod._eigh(_factor(16, torch.float32))
        monkeypatch.setattr(eigh_mod, "EIGH_SERIAL_MAX", 2048)
        monkeypatch.setenv("OMP_WAIT_POLICY", "passive")  # threads that sleep at barriers: keep them
        eigh_mod._eigh(_factor(16, torch.float32))
        assert seen == [1, 2, 2] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_small_cpu_factors_are_decomposed_side_by_side_like_one_by_one(monkeypatch):
    """Factors up to EIGH_SERIAL_MAX go to a pool of one-thread workers (each result equals
    a one-thread ``_eigh``, bit for bit); wider ones run one by one with every thread; the
    thread setting is restored."""
    mats = [_factor(n, torch.float32, seed=n) for n in (24, 40, 16, 64, 32)]
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = [eigh_mod._eigh(M) for M in mats]
        torch.set_num_threads(2)
        monkeypatch.setattr(eigh_mod, "EIGH_SERIAL_MAX", 40)  # 64 is "wide": sequential
        workers, real = set(), eigh_mod._eigh

        def counted(M):
            import threading
            workers.add((threading.get_ident(), torch.get_num_threads(), M.shape[0] <= 40))
            return real(M)
        monkeypatch.setattr(eigh_mod, "_eigh", counted)
        got = dict(eigh_mod._eigh_many(lambda i: mats[i], [4, 0, 1, 2, 3]))
        assert sorted(got) == [0, 1, 2, 3, 4] and torch.get_num_threads() == 2
        for i, (lam, Q) in got.items():
            assert torch.equal(lam, ref[i][0]) and torch.equal(Q, ref[i][1])
        assert {(n, small) for _, n, small in workers} == {(1, True), (2, False)}
        assert len({t for t, _, small in workers if small}) >= 1
    finally:
        torch.set_num_threads(before)


def test_side_by_side_runs_one_thread_workers_and_restores_the_threads():
    """``gradients.side_by_side`` (the spilled fit's and scores' task runner): results in the items'
    order, every worker at one thread, this thread's setting restored."""
    import threading

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen = []

        def fn(i):
            seen.append((threading.get_ident(), torch.get_num_threads()))
            return i * i
        assert list(side_by_side(fn, list(range(7)))) == [i * i for i in range(7)]
        assert {n for _, n in seen} == {1} and threading.get_ident() not in {t for t, _ in seen}
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_cuda_factors_side_by_side_are_bounded_by_the_streams_and_the_free_memory(monkeypatch):
    monkeypatch.setattr(eigh_mod, "CUDA_EIGH_STREAMS", 4)
    n = 14336
    assert eigh_mod.cuda_side_by_side(n, 4, 130 << 30) == eigh_mod.CUDA_EIGH_STREAMS
    each = 3 * n * n * 4  # eigenvectors and workspace, about three matrices
    assert eigh_mod.cuda_side_by_side(n, 4, int(2 * each / eigh_mod.CUDA_EIGH_FREE_SHARE)) == 2
    assert eigh_mod.cuda_side_by_side(n, 4, 1 << 20) == 1  # never fewer than one


def test_cuda_free_memory_counts_the_allocators_unused_cache(monkeypatch):
    """After a fit's passes PyTorch's cache holds most of their peak: the driver calls it
    used, yet the side-by-side solvers' workspaces can take it."""
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2 * gib, 140 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 120 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 70 * gib)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: type("P", (), {"total_memory": 140 * gib}))
    assert allocatable_bytes("cuda:0") == (2 + 120 - 70) * gib
    monkeypatch.setattr(eigh_mod, "CUDA_EIGH_STREAMS", 4)
    # with the driver's 2 GiB alone one 14336-wide factor at a time; with the cache, four
    assert eigh_mod.cuda_side_by_side(14336, 4, 2 * gib) == 1
    assert eigh_mod.cuda_side_by_side(14336, 4, allocatable_bytes("cuda:0")) == 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_factors_side_by_side_equal_one_by_one(monkeypatch):
    """Every CUDA factor yielded once, each equal to its own `_eigh` (the same solver on
    the same matrix, from side streams), widths mixed and a window wider than a run."""
    monkeypatch.setattr(eigh_mod, "CUDA_EIGH_STREAMS", 4)
    sizes = [384, 1024, 384, 1024, 384, 64, 1024, 1024, 1024]
    mats = [_factor(n, torch.float32, seed=i).cuda() for i, n in enumerate(sizes)]
    got = dict(eigh_mod._eigh_many(lambda i: mats[i], list(range(len(mats)))))
    assert sorted(got) == list(range(len(mats)))
    torch.cuda.synchronize()
    for i, M in enumerate(mats):
        lam, Q = eigh_mod._eigh(M)
        # float32 as the input: a side thread whose solver failed would have fallen back to float64
        assert got[i][1].dtype == M.dtype and torch.equal(got[i][0], lam) and torch.equal(got[i][1], Q)
