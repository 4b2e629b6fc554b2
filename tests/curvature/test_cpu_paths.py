"""The CPU-only paths of the fit: factors formed as their lower block triangle
and mirrored (``factors.GRAM_BLOCK``), and the EK-FAC eigenvalues summed example by example
into a reused buffer, against float64 references from explicit per-example gradients."""

import pytest
from conftest import write_inputs
import torch

from prism_select.curvature import eigenvalues as eigenvalues_mod, factors as factors_mod, spill as spill_mod
from prism_select.curvature import CurvatureSettings, FitSpill, fit_curvature
from prism_select.curvature import fit as fit_mod

from reference import explicit_fisher_pieces, rel_err

# float64 end to end: summation order and the eigensolver only (as test_numerics)
CPU_PATH_REL_TOL = 1e-9
#: blocks this narrow cut the tiny model's 16- and 32-wide factors into 4 and 7 blocks
TINY_BLOCK = 5


def test_gram_lower_blocks_mirrored_equal_the_full_product():
    g = torch.Generator().manual_seed(0)
    for d in (4, 5, 6, 13, 32):
        a = torch.randn(11, d, dtype=torch.float64, generator=g)
        M = torch.randn(d, d, dtype=torch.float64, generator=g)
        M = M + M.T
        ref = M + a.T @ a
        old = factors_mod.GRAM_BLOCK
        factors_mod.GRAM_BLOCK = TINY_BLOCK
        try:
            got = factors_mod._mirror(factors_mod._gram_into(M.clone(), a))
            got2 = factors_mod._mirror(factors_mod._gram(a, torch.float64))
        finally:
            factors_mod.GRAM_BLOCK = old
        assert rel_err(got, ref) <= 1e-14, d
        assert rel_err(got2, a.T @ a) <= 1e-14, d
        assert torch.equal(got, got.T)


@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
@pytest.mark.parametrize("layer", ["model.layers.1.mlp.down_proj", "model.layers.0.self_attn.q_proj"])
def test_blocked_fit_matches_explicit_factors(model, modules, tok, encoded_pool, monkeypatch, kind, layer):
    monkeypatch.setattr(factors_mod, "GRAM_BLOCK", TINY_BLOCK)
    monkeypatch.setattr(eigenvalues_mod, "LAMBDA_BLOCK_ROWS", TINY_BLOCK)  # the products in row blocks too
    cur = fit_curvature(model, modules, encoded_pool, CurvatureSettings(kind=kind, damping=1e-3, batch_size=3),
                        pad_id=tok.pad_token_id)
    A, S, G = explicit_fisher_pieces(model, modules, layer, encoded_pool, tok)
    QA, QS = cur.tensors[f"{layer}::QA"], cur.tensors[f"{layer}::QS"]
    assert rel_err(QA @ torch.diag(cur.tensors[f"{layer}::lamA"]) @ QA.T, A) <= CPU_PATH_REL_TOL
    assert rel_err(QS @ torch.diag(cur.tensors[f"{layer}::lamS"]) @ QS.T, S) <= CPU_PATH_REL_TOL
    if kind == "ekfac":
        R2 = (QS.T @ G @ QA) ** 2
        assert rel_err(cur.tensors[f"{layer}::Lambda"], R2.mean(0)) <= CPU_PATH_REL_TOL
        var = float(R2.var(0, unbiased=True).sum()) / G.shape[0]
        assert float(cur.tensors[f"{layer}::LambdaVar"]) == pytest.approx(var, rel=CPU_PATH_REL_TOL)


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("out", [4, 16, 17])
def test_eigenvalue_sums_in_row_blocks_equal_the_whole_products(monkeypatch, keep, out):
    """The CPU eigenvalue pass forms each example's product ``R_n = bq_n^T aq_n`` in blocks of
    rows (``LAMBDA_BLOCK_ROWS``): ``Lambda``'s sum, ``M4`` and the kept products are those
    of the whole products, whether the rows divide into the blocks or not."""
    from prism_select.curvature.stats import _Stats
    monkeypatch.setattr(eigenvalues_mod, "LAMBDA_BLOCK_ROWS", TINY_BLOCK)
    g = torch.Generator().manual_seed(0)
    B, T, inp = 3, 6, 7
    aq = torch.randn(B, T, inp, dtype=torch.float64, generator=g)
    bq = torch.randn(B, T, out, dtype=torch.float64, generator=g)
    R = torch.einsum("bto,bti->boi", bq, aq)
    tap = eigenvalues_mod._LambdaTap.__new__(eigenvalues_mod._LambdaTap)
    tap.stats = _Stats(torch.float64)
    Lam, M4 = torch.zeros(out, inp, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
    kept = torch.full((B, out, inp), float("nan"), dtype=torch.float64) if keep else None
    tap.add(aq, bq, Lam, M4, keep=None if kept is None else list(kept))
    assert rel_err(Lam, (R ** 2).sum(0)) <= 1e-14
    assert float(M4) == pytest.approx(float((R ** 4).sum()), rel=1e-14)
    if keep:
        assert rel_err(kept, R) <= 1e-14


@pytest.mark.parametrize("fisher", ["empirical", "sampled"])
def test_spilled_eigenvalue_pass_equals_running_the_model_again(model, modules, tok, encoded_pool, monkeypatch,
                                                               fisher):
    """EK-FAC's eigendecompositions and eigenvalue pass from the factor pass's spill file, group
    by group on one-thread workers, give the same curvature as the eigendecompositions one
    after the other and an eigenvalue pass that runs the model again."""
    calls = []
    spilled = spill_mod._spilled_groups
    monkeypatch.setattr(fit_mod, "_spilled_groups", lambda *a, **k: (calls.append(1), spilled(*a, **k))[1])
    settings = CurvatureSettings(kind="ekfac", damping=1e-3, batch_size=3, fisher=fisher)
    got = fit_curvature(model, modules, encoded_pool, settings, pad_id=tok.pad_token_id)
    assert calls == [1]
    monkeypatch.setattr(spill_mod, "SPILL_MAX_BYTES", 0)
    ref = fit_curvature(model, modules, encoded_pool, settings, pad_id=tok.pad_token_id)
    assert calls == [1]
    for k, t in ref.tensors.items():
        assert rel_err(got.tensors[k], t) <= 1e-14, k


def test_eigendecompositions_have_a_progress_bar(model, modules, tok, encoded_pool, monkeypatch, capsys):
    """The eigendecompositions show progress: one bar step per factor (fit from the model)
    or per layer input, whose task decomposes its factors (fit from the spill)."""
    import re
    settings = CurvatureSettings(kind="ekfac", damping=1e-3, batch_size=3)
    fit_curvature(model, modules, encoded_pool, settings, pad_id=tok.pad_token_id)
    assert re.search(r"curvature:\s+0%\|[^|]*\| 0/\d+ .*group/s", capsys.readouterr().err)
    monkeypatch.setattr(spill_mod, "SPILL_MAX_BYTES", 0)
    fit_curvature(model, modules, encoded_pool, settings, pad_id=tok.pad_token_id)
    n = re.search(r"eigendecompositions:\s+0%\|[^|]*\| 0/(\d+) .*factor/s", capsys.readouterr().err)
    assert n and int(n.group(1)) > len(modules)  # each layer's S and the layer inputs' A


def test_eigendecompositions_hand_back_each_freed_factor(model, modules, tok, encoded_pool, monkeypatch):
    """Fit from the model on the CPU: the heap is trimmed after every decomposed factor, not
    only when the phase is over (untrimmed, the embedded model's phase held ~560 MiB of freed
    factors and LAPACK scratch above its results: the highest plateau of the CPU fit)."""
    monkeypatch.setattr(spill_mod, "SPILL_MAX_BYTES", 0)
    decomposed, trims = [], []
    from prism_select.curvature import eigh as eigh_mod
    eigh = eigh_mod._eigh
    monkeypatch.setattr(eigh_mod, "_eigh", lambda M: decomposed.append(M.shape) or eigh(M))
    monkeypatch.setattr(fit_mod, "release_host_memory", lambda: trims.append(len(decomposed)))
    settings = CurvatureSettings(kind="kfac", damping=1e-3, batch_size=3)
    fit_curvature(model, modules, encoded_pool, settings, pad_id=tok.pad_token_id)
    assert len(decomposed) > len(modules)  # each layer's S and the layer inputs' A
    during = [t for t in trims if 0 < t <= len(decomposed)]
    assert len(during) >= len(decomposed)


def test_spill_is_bounded(model, modules, tok, encoded_pool, monkeypatch):
    from prism_select.curvature.fit import length_batches
    from prism_select.curvature.spill import _spill_bytes
    batches = length_batches(encoded_pool, list(range(len(encoded_pool))), 3)
    need = _spill_bytes(modules, encoded_pool, batches, 8)
    s = CurvatureSettings(kind="ekfac", batch_size=3)
    monkeypatch.setattr(spill_mod, "SPILL_MAX_BYTES", need)
    assert spill_mod._spill_wanted(model, modules, encoded_pool, batches, None, s, None)
    monkeypatch.setattr(spill_mod, "SPILL_MAX_BYTES", need - 1)
    assert not spill_mod._spill_wanted(model, modules, encoded_pool, batches, None, s, None)
    monkeypatch.setattr(spill_mod, "SPILL_MAX_BYTES", need)
    assert not spill_mod._spill_wanted(model, modules, encoded_pool, batches, None,
                                     CurvatureSettings(kind="kfac", batch_size=3), None)


def test_fitted_eigenbases_are_row_major(model, modules, tok, encoded_pool):
    """LAPACK returns column-major eigenvectors; kept so, every one would be copied
    whole when the curvature is saved (host memory)."""
    cur = fit_curvature(model, modules, encoded_pool, CurvatureSettings(kind="ekfac", batch_size=3),
                        pad_id=tok.pad_token_id)
    from prism_select.curvature.base import _host_tensors
    host = _host_tensors(cur.tensors)
    assert all(host[k].data_ptr() == t.data_ptr() for k, t in cur.tensors.items())


def test_precondition_consuming_its_input_gives_the_same_result(model, modules, tok, encoded_pool):
    cur = fit_curvature(model, modules, encoded_pool, CurvatureSettings(kind="ekfac", damping=1e-3, batch_size=3),
                        pad_id=tok.pad_token_id)
    g = {n: torch.randn(m.weight.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
         for i, (n, m) in enumerate(modules.items())}
    ref = cur.precondition(dict(g))
    given = dict(g)
    got = cur.precondition(given, consume=True)
    assert given == {}
    assert list(got) == list(ref)
    assert all(torch.equal(got[n], ref[n]) for n in ref)


def test_spilled_layers_read_back_every_dtype_and_empty_the_source(tmp_path):
    from prism_select.gradients import SpilledLayers
    g = torch.Generator().manual_seed(0)
    src = {"a": torch.randn(3, 5, dtype=torch.float64, generator=g),
           "b": torch.randn(4, 2, generator=g).to(torch.bfloat16),
           "c": torch.arange(6, dtype=torch.float32).reshape(2, 3).T,  # not contiguous
           "d": torch.zeros(0, 3)}
    ref = {k: v.clone() for k, v in src.items()}
    s = SpilledLayers(src, tmp_path)
    assert src == {}  # the caller's dict no longer holds the tensors
    assert list(s) == ["a", "b", "c", "d"] and len(s) == 4 and "b" in s
    assert torch.equal(s["c"], ref["c"]) and "c" in s  # [] reads and keeps
    for k in ("b", "a", "d", "c"):
        got = s.pop(k)
        assert got.dtype == ref[k].dtype and got.shape == ref[k].shape and torch.equal(got, ref[k]), k
        assert k not in s
    assert len(s) == 0 and s._f.closed  # the file goes with the last layer


def test_spilled_layers_leave_the_source_whole_when_the_disk_refuses(tmp_path, monkeypatch):
    import errno
    import tempfile

    from prism_select.gradients import SpilledLayers

    class Full:
        closed = False

        def seek(self, *a):
            return 0

        def write(self, b):
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self):
            self.closed = True

    full = Full()
    monkeypatch.setattr(tempfile, "TemporaryFile", lambda **kw: full)
    src = {"a": torch.ones(2, 2), "b": torch.zeros(3)}
    with pytest.raises(OSError):
        SpilledLayers(src, tmp_path)
    assert list(src) == ["a", "b"] and full.closed


@pytest.mark.parametrize("kind", ["ekfac", "kfac", "diagonal"])
def test_precondition_releasing_the_curvature_gives_the_same_result(model, modules, tok, encoded_pool, kind,
                                                                    tmp_path):
    from prism_select.errors import ConfigError
    from prism_select.gradients import SpilledLayers
    cur = fit_curvature(model, modules, encoded_pool, CurvatureSettings(kind=kind, damping=1e-3, batch_size=3),
                        pad_id=tok.pad_token_id)
    g = {n: torch.randn(m.weight.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
         for i, (n, m) in enumerate(modules.items())}
    ref = cur.precondition(dict(g))
    got = cur.precondition(SpilledLayers(dict(g), tmp_path), consume=True, release=True)
    assert list(got) == list(ref)
    assert all(torch.equal(got[n], ref[n]) for n in ref)
    assert cur.tensors == {}  # each layer's factors freed once used
    with pytest.raises(ConfigError, match="released"):
        cur.precondition(dict(g))


def _saved_curvature(model, modules, tok, encoded_pool, directory, kind="ekfac"):
    cur = fit_curvature(model, modules, encoded_pool, CurvatureSettings(kind=kind, damping=1e-3, batch_size=3),
                        pad_id=tok.pad_token_id)
    cur.save(directory, {"k": 1})
    return cur


def test_loaded_curvature_stays_in_its_file_until_read(model, modules, tok, encoded_pool, tmp_path):
    """On the host a saved curvature is not read at load: each tensor is read from the file
    when asked for, into memory of its own (not mapped: overwriting the file's bytes after
    a read leaves the tensor read), equal to ``load_file``'s, in its order. The file is held
    open, so the cache replacing it by an atomic rename or evicting it while a run uses it
    changes nothing that run reads."""
    from safetensors.torch import load_file

    from prism_select.curvature.base import Curvature, HostTensorFiles
    from prism_select.errors import CacheError
    _saved_curvature(model, modules, tok, encoded_pool, tmp_path)
    f = tmp_path / "factors.safetensors"
    original = f.read_bytes()
    ref = {k: v.clone() for k, v in load_file(str(f)).items()}
    back = Curvature.load(tmp_path, expect={"k": 1})
    assert isinstance(back.tensors, HostTensorFiles)
    assert list(back.tensors) == list(ref)
    first = next(iter(ref))
    read = back.tensors[first]
    size = f.stat().st_size
    with open(f, "r+b") as fh:  # the header stays, every tensor's bytes become 0xFF (NaN)
        n = int.from_bytes(fh.read(8), "little")
        fh.seek(8 + n)
        fh.write(b"\xff" * (size - 8 - n))
    assert torch.equal(read, ref[first])  # a tensor read is memory of its own
    assert back.tensors[first].isnan().all()  # ... and the next read reads the file
    with pytest.raises(CacheError, match="does not match its checksum"):  # changed in place since the save
        Curvature.load(tmp_path, expect={"k": 1})
    f.write_bytes(original)
    back = Curvature.load(tmp_path, expect={"k": 1})
    tmp = tmp_path / ".replacement"
    tmp.write_bytes(b"not a curvature")
    tmp.replace(f)  # the cache's atomic write of another fit
    (tmp_path / "curvature.json").unlink()
    f.unlink()  # the cache evicting the entry
    assert all(torch.equal(back.tensors[k], ref[k]) for k in ref)  # read from the file it opened
    assert all(t.dtype == ref[k].dtype and t.shape == ref[k].shape for k, t in back.tensors.items())


def test_loaded_curvature_refuses_a_truncated_file(model, modules, tok, encoded_pool, tmp_path):
    from prism_select.curvature.base import Curvature
    from prism_select.errors import CacheError
    _saved_curvature(model, modules, tok, encoded_pool, tmp_path)
    f = tmp_path / "factors.safetensors"
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size - 8)
    with pytest.raises(CacheError, match="does not match its checksum"):
        Curvature.load(tmp_path)


@pytest.mark.parametrize("kind", ["ekfac", "kfac", "diagonal"])
def test_loaded_curvature_preconditions_as_the_fitted_one_reading_a_layer_at_a_time(
        model, modules, tok, encoded_pool, tmp_path, monkeypatch, kind):
    """Preconditioning from a loaded curvature equals the fitted one's, again and again, and
    with ``release`` (the caller's last use) each layer is read once and dropped: the tensors
    read and still alive never exceed the few layers in flight (``side_by_side``'s window),
    where loading used to read the whole file; the file is closed once every layer is used."""
    import gc
    import weakref

    from prism_select.curvature.base import Curvature, HostTensorFiles
    from prism_select.curvature.base import apply_damping
    from prism_select.curvature.base import PreconditionSettings
    fitted = _saved_curvature(model, modules, tok, encoded_pool, tmp_path, kind)
    g = {n: torch.randn(m.weight.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
         for i, (n, m) in enumerate(modules.items())}
    ref = fitted.precondition(dict(g))
    settings = PreconditionSettings(damping=1e-3)
    back = apply_damping(Curvature.load(tmp_path), settings)
    assert back.damping == fitted.damping
    assert all(torch.equal(got, ref[n]) for n, got in back.precondition(dict(g)).items())
    live, most, reads = set(), [0], []
    real = HostTensorFiles.__getitem__

    def counted(self, key):
        t = real(self, key)
        token = object()
        live.add(token)
        weakref.finalize(t, live.discard, token)
        most[0] = max(most[0], len(live))
        reads.append(key)
        return t

    monkeypatch.setattr(HostTensorFiles, "__getitem__", counted)
    gc.collect()
    got = back.precondition(dict(g), consume=True, release=True)
    assert all(torch.equal(got[n], ref[n]) for n in ref)
    per_layer = {"ekfac": 3, "kfac": 4, "diagonal": 1}[kind]  # tensors read for one layer (no shrinkage)
    window = torch.get_num_threads() + 2  # side_by_side's window, and the layer being read
    assert len(modules) > window
    assert len(reads) <= per_layer * len(modules)
    assert 0 < most[0] <= per_layer * window
    assert len(back.tensors) == 0 and all(f.closed for f in back.tensors._files)


@pytest.mark.parametrize("libc", ["missing", "without malloc_trim"])
def test_release_host_memory_is_safe_to_call(monkeypatch, libc):
    """Where the C library cannot be loaded, or has no ``malloc_trim`` (not glibc), the
    call does nothing, raises nothing and does not try again."""
    import ctypes
    import sys

    from prism_select import gradients as grad_mod
    if not sys.platform.startswith("linux"):
        pytest.skip("the trim is glibc's")
    loads = []

    def load(name):
        loads.append(name)
        if libc == "missing":
            raise OSError("no C library here")
        return type("Musl", (), {})()  # a C library without malloc_trim
    monkeypatch.setattr(grad_mod, "_libc", None)
    monkeypatch.setattr(ctypes, "CDLL", load)
    assert grad_mod.release_host_memory() is None
    assert grad_mod.release_host_memory() is None
    assert len(loads) == 1 and grad_mod._libc is False


def test_release_host_memory_trims_only_after_work_on_the_cpu(monkeypatch):
    """Work that ran on an accelerator left nothing on the host heap: no trim for it."""
    import sys

    from prism_select import gradients as grad_mod
    if not sys.platform.startswith("linux"):
        pytest.skip("the trim is glibc's")
    calls = []
    monkeypatch.setattr(grad_mod, "_libc", type("Libc", (), {"malloc_trim": staticmethod(calls.append)})())
    grad_mod.release_host_memory(torch.device("cuda", 0))
    grad_mod.release_host_memory("mps")
    assert calls == []
    grad_mod.release_host_memory(torch.device("cpu"))
    grad_mod.release_host_memory()
    assert calls == [0, 0]


#: float64 end to end: the spilled products and exact scoring differ in GEMM order and
#: padding (the fit's batches of 3 against scoring's of 4) only
SPILL_SCORE_REL_TOL = 1e-12


def test_scores_from_the_fit_spill_equal_exact_scoring(model, modules, tok, encoded_pool):
    """``_Spill.scores`` (the factor pass's layer inputs and output gradients, contracted with
    ``V``) equals exact scoring, which runs the model's forward and backward again."""
    from prism_select.runtime.layers import layer_shape
    from prism_select.scoring import score_encoded

    kept = []
    settings = CurvatureSettings(kind="ekfac", damping=1e-3, batch_size=3)
    fit_curvature(model, modules, encoded_pool, settings, pad_id=tok.pad_token_id,
                  spill=FitSpill(on_spill=kept.append))
    assert len(kept) == 1
    g = torch.Generator().manual_seed(1)
    V = {n: torch.randn(*layer_shape(m), dtype=torch.float64, generator=g) for n, m in modules.items()}
    try:
        got = kept[0].scores(modules, V, len(encoded_pool))
        # a layer without spilled entries: no scores from the spill
        assert kept[0].scores({**modules, "lm_head": model.lm_head}, {**V, "lm_head": None}, len(encoded_pool)) is None
    finally:
        kept[0].close()
    ref = score_encoded(model, modules, encoded_pool, V, pad_id=tok.pad_token_id, batch_size=4)
    assert got.dtype == torch.float64 and got.shape == ref.shape
    assert rel_err(got, ref) <= SPILL_SCORE_REL_TOL


@pytest.mark.parametrize("asked, fisher, fit_examples, from_spill", [
    (True, "empirical", None, True), (True, "sampled", None, False), (True, "empirical", 5, False),
    (False, "empirical", None, False)])
def test_run_scores_from_the_fit_spill_only_when_it_holds_the_scoring_gradients(
        model, tok, tmp_path, pool_examples, pair_examples, monkeypatch, asked, fisher, fit_examples, from_spill):
    """A PRISM run asked to (``scores_from_fit``) whose EK-FAC fit covers the whole pool with
    the empirical Fisher scores from the fit's spill (no scoring pass over the model), with
    the scores of a run without the spill; with sampled labels, a fit sample or by default
    it scores with the model."""
    import json

    from prism_select.model import LoadedModel, ModelSettings, model_fingerprint
    from prism_select.run import score_pool
    from prism_select.settings import ScoreSettings

    pool, targets = write_inputs(tmp_path, pool_examples, pair_examples)
    monkeypatch.setattr(spill_mod, "FIT_SCORES_MAX_BYTES", 0)  # not inside the fit (test_run_scores_inside_the_fit)
    calls = []
    real = spill_mod._Spill.scores
    monkeypatch.setattr(spill_mod._Spill, "scores", lambda self, *a: (calls.append(1), real(self, *a))[1])
    cs = CurvatureSettings(kind="ekfac", fisher=fisher, fit_examples=fit_examples, batch_size=3,
                           damping_rule="heuristic")  # the route, not the damping, is under test

    def run(name):
        lm = LoadedModel(model, tok, ModelSettings(model="tiny-test", device="cpu", cache_dir=str(tmp_path / name)),
                         model_fingerprint(model), {"kind": "test"})
        summary = score_pool(lm, pool, targets, tmp_path / name / "run",
                             ScoreSettings(batch_size=4, progress=False, scores_from_fit=asked), cs)
        rows = [json.loads(x) for x in (tmp_path / name / "run" / "scores.jsonl").read_text().splitlines()]
        return summary, torch.tensor([r["score"] for r in sorted(rows, key=lambda r: r["id"])], dtype=torch.float64)

    got_summary, got = run("spill")
    assert calls == ([1] if from_spill else [])
    assert bool(got_summary["throughput"]["scores"].get("from_fit_spill")) == from_spill
    monkeypatch.setattr(spill_mod, "SPILL_MAX_BYTES", 0)
    _, ref = run("model")
    assert len(calls) == int(from_spill)
    assert rel_err(got, ref) <= SPILL_SCORE_REL_TOL


#: float64 end to end: the fit's products R_n against the model's forward and backward,
#: and ``v`` against its rotation alone (summation order)
FIT_SCORE_REL_TOL = 1e-12


@pytest.mark.parametrize("precondition", [{"damping": 1e-3}, {"shrinkage": "auto", "damping_noise": True}])
def test_scores_inside_the_fit_equal_preconditioned_exact_scoring(model, modules, tok, encoded_pool, precondition):
    """:class:`spill.FitScores`: the spilled fit's tasks score the fit examples from their
    rotated per-example gradients, as exact scoring of ``v = H^-1 d`` with the fitted
    curvature does; the curvature is bit-identical to a fit that does not score, and the
    direction's layers are taken out of it."""
    from prism_select.runtime.layers import layer_shape
    from prism_select.scoring import score_encoded

    settings = CurvatureSettings(kind="ekfac", batch_size=3, **precondition)
    g = torch.Generator().manual_seed(2)
    d = {n: torch.randn(*layer_shape(m), dtype=torch.float64, generator=g) for n, m in modules.items()}
    direction = dict(d)
    fs = spill_mod.FitScores(direction, settings, len(encoded_pool))
    cur = fit_curvature(model, modules, encoded_pool, settings, pad_id=tok.pad_token_id, spill=FitSpill(scores=fs))
    ref_cur = fit_curvature(model, modules, encoded_pool, settings, pad_id=tok.pad_token_id)
    assert list(cur.tensors) == list(ref_cur.tensors)
    assert all(torch.equal(cur.tensors[k], ref_cur.tensors[k]) for k in cur.tensors)
    assert cur.damping == ref_cur.damping and cur.shrinkage == ref_cur.shrinkage
    assert direction == {}
    v = ref_cur.precondition(d)
    ref = score_encoded(model, modules, encoded_pool, v, pad_id=tok.pad_token_id, batch_size=4)
    assert fs.scores.dtype == torch.float64 and fs.scores.shape == ref.shape
    assert rel_err(fs.scores, ref) <= FIT_SCORE_REL_TOL


def test_fit_does_not_score_beyond_its_memory_bound(model, modules, tok, encoded_pool):
    """Kept products above ``max_bytes``: no scores, the direction left whole, the same fit."""
    from prism_select.runtime.layers import layer_shape

    settings = CurvatureSettings(kind="ekfac", damping=1e-3, batch_size=3)
    direction = {n: torch.ones(*layer_shape(m), dtype=torch.float64) for n, m in modules.items()}
    fs = spill_mod.FitScores(direction, settings, len(encoded_pool), max_bytes=0)
    kept = []
    cur = fit_curvature(model, modules, encoded_pool, settings, pad_id=tok.pad_token_id,
                        spill=FitSpill(on_spill=kept.append, scores=fs))
    ref_cur = fit_curvature(model, modules, encoded_pool, settings, pad_id=tok.pad_token_id)
    assert fs.scores is None and set(direction) == set(modules)
    assert len(kept) == 1  # the spill goes to on_spill, to score from after the fit
    kept[0].close()
    assert all(torch.equal(cur.tensors[k], ref_cur.tensors[k]) for k in cur.tensors)


def test_run_scores_inside_the_fit(model, tok, tmp_path, pool_examples, pair_examples, monkeypatch):
    """A demo-like run (``scores_from_fit``, the pool its fit sample): the fit scores the pool
    (no v, no scoring pass over the spill or the model), with the scores of a run scored by
    the model to FIT_SCORE_REL_TOL; a second run, its curvature from the cache, scores with
    the model."""
    import json

    from prism_select.model import LoadedModel, ModelSettings, model_fingerprint
    from prism_select.run import score_pool
    from prism_select.settings import ScoreSettings

    pool, targets = write_inputs(tmp_path, pool_examples, pair_examples)
    cs = CurvatureSettings(kind="ekfac", batch_size=3, damping_rule="heuristic")  # the spill route needs it
    spill_calls = []
    real = spill_mod._Spill.scores
    monkeypatch.setattr(spill_mod._Spill, "scores", lambda self, *a: (spill_calls.append(1), real(self, *a))[1])

    def run(name, cache):
        lm = LoadedModel(model, tok, ModelSettings(model="tiny-test", device="cpu", cache_dir=str(tmp_path / cache)),
                         model_fingerprint(model), {"kind": "test"})
        summary = score_pool(lm, pool, targets, tmp_path / name,
                             ScoreSettings(batch_size=4, progress=False, scores_from_fit=True), cs)
        rows = [json.loads(x) for x in (tmp_path / name / "scores.jsonl").read_text().splitlines()]
        return summary, torch.tensor([r["score"] for r in sorted(rows, key=lambda r: r["id"])], dtype=torch.float64)

    got_summary, got = run("fit", "c1")
    assert got_summary["throughput"]["scores"].get("in_fit") is True
    assert not (tmp_path / "fit" / ".partial").exists()
    again_summary, again = run("again", "c1")  # the curvature reused: scored by the model
    assert again_summary["curvature"]["reused"] and "in_fit" not in again_summary["throughput"]["scores"]
    monkeypatch.setattr(spill_mod, "SPILL_MAX_BYTES", 0)
    _, ref = run("model", "c2")
    assert spill_calls == []
    assert rel_err(got, ref) <= FIT_SCORE_REL_TOL
    assert rel_err(again, ref) <= FIT_SCORE_REL_TOL


#: float64 end to end: the eigenvalue pass in smaller steps differs from the whole batches by
#: summation order and padding alone
LAMBDA_STEPS_REL_TOL = 1e-12


def _eigenvalue_pass_spy(monkeypatch):
    """Wraps ``fit._passes``: each pass's taps and the batches it ran."""
    seen = []
    passes = fit_mod._passes

    def spy(model, taps, stats, encoded, batches, *a, **k):
        seen.append((dict(taps), [list(b) for b in batches]))
        return passes(model, taps, stats, encoded, batches, *a, **k)

    monkeypatch.setattr(fit_mod, "_passes", spy)
    return seen


def test_cpu_eigenvalue_pass_runs_in_bounded_steps(model, modules, tok, encoded_pool, monkeypatch):
    """On the CPU (the model run again, the empirical Fisher) the eigenvalue pass cuts each
    fit batch into steps whose tracked layers' inputs and outputs take at most
    ``LAMBDA_STEP_MAX_BYTES`` (one example at least), so its activations do not scale with
    the batch; the curvature equals that of whole batches to float64 rounding."""
    from prism_select.runtime.layers import layer_shape
    monkeypatch.setattr(spill_mod, "SPILL_MAX_BYTES", 0)
    settings = CurvatureSettings(kind="ekfac", damping=1e-3, batch_size=4)
    per_token = sum(sum(layer_shape(m)) * m.weight.element_size() for m in modules.values())
    longest = max(len(e.input_ids) for e in encoded_pool)
    monkeypatch.setattr(eigenvalues_mod, "LAMBDA_STEP_MAX_BYTES", 2 * per_token * longest)  # two examples a step
    seen = _eigenvalue_pass_spy(monkeypatch)
    got = fit_curvature(model, modules, encoded_pool, settings, pad_id=tok.pad_token_id)
    (_, factor_batches), (_, steps) = seen
    assert max(len(b) for b in factor_batches) == 4
    assert max(len(s) for s in steps) == 2
    assert [i for s in steps for i in s] == [i for b in factor_batches for i in b]  # the same examples, in order
    for s in steps:
        assert per_token * len(s) * max(len(encoded_pool[i].input_ids) for i in s) <= eigenvalues_mod.LAMBDA_STEP_MAX_BYTES
    monkeypatch.setattr(eigenvalues_mod, "LAMBDA_STEP_MAX_BYTES", 1 << 60)  # whole batches
    ref = fit_curvature(model, modules, encoded_pool, settings, pad_id=tok.pad_token_id)
    assert seen[-1][1] == factor_batches
    assert list(got.tensors) == list(ref.tensors)
    for k, t in ref.tensors.items():
        assert rel_err(got.tensors[k], t) <= LAMBDA_STEPS_REL_TOL, k
    # the sampled Fisher keeps the factor pass's batches (its labels are drawn batch by batch)
    seen.clear()
    monkeypatch.setattr(eigenvalues_mod, "LAMBDA_STEP_MAX_BYTES", 1)
    fit_curvature(model, modules, encoded_pool, CurvatureSettings(kind="ekfac", damping=1e-3, batch_size=4,
                                                                 fisher="sampled"),
                  pad_id=tok.pad_token_id)
    assert seen[1][1] == seen[0][1]


def test_layers_reading_one_input_share_its_eigenbasis_during_the_eigenvalue_pass(model, modules, tok,
                                                                                 encoded_pool, monkeypatch):
    """q/k/v (and gate/up) read one input and have one ``QA``: the eigenvalue pass holds it
    once (its copies would be 0.12 GB of the embedded model's eigenbases); each layer's
    saved tensors are its own afterwards (safetensors refuses shared storage)."""
    monkeypatch.setattr(spill_mod, "SPILL_MAX_BYTES", 0)
    seen = _eigenvalue_pass_spy(monkeypatch)
    cur = fit_curvature(model, modules, encoded_pool, CurvatureSettings(kind="ekfac", damping=1e-3, batch_size=3),
                        pad_id=tok.pad_token_id)
    taps = seen[1][0]
    for i in range(2):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        q = taps[attn + "q_proj"].QA
        assert taps[attn + "k_proj"].QA.data_ptr() == q.data_ptr() == taps[attn + "v_proj"].QA.data_ptr()
        assert taps[mlp + "up_proj"].QA.data_ptr() == taps[mlp + "gate_proj"].QA.data_ptr()
        assert taps[attn + "o_proj"].QA.data_ptr() != q.data_ptr()
    ptrs = [t.untyped_storage().data_ptr() for t in cur.tensors.values()]
    assert len(set(ptrs)) == len(ptrs)
    assert torch.equal(cur.tensors["model.layers.0.self_attn.q_proj::QA"],
                       cur.tensors["model.layers.0.self_attn.k_proj::QA"])
