"""CUDA-graph scoring (prism_select/runtime/graphs.py): bucketing and padding on the CPU in
float64 against unpadded eager scores; capture and replay against eager on a GPU."""

import pytest
import torch

from prism_select.curvature import factors as factors_mod, spill as spill_mod, stats as stats_mod
from prism_select import engine
from prism_select.data.tokenize import encode
from prism_select.errors import ConfigError
from prism_select.runtime.graphs import (BUCKET_FRACTION, MIN_BUCKET, GraphedScorer, bucket_length,
                                         graphs_wanted)
from prism_select.runtime.execution import ExecutionContext
from prism_select.scoring import make_scorer, score_encoded

from tiny import tiny_llama

#: padded + bucketed vs unpadded eager scores, float64 CPU (same math, other padding)
PAD_RTOL = 1e-10
#: captured graph vs eager on the GPU in float32 (kernel choice may differ: sdpa causal
#: kernel in both, but cuBLAS may pick other algorithms for the padded shapes)
GPU_F32_RTOL = 1e-4

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def rel_err(a, b):
    return float((a - b).norm() / b.norm())


@pytest.fixture
def encoded_pool(tok, pool_examples):
    return [encode(tok, p, r) for p, r in pool_examples]


def _direction(modules, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(m.out_features, m.in_features + int(m.bias is not None), generator=g,
                           dtype=torch.float64).to(dtype) for n, m in modules.items()}


def test_bucket_length_bounds():
    prev = 0
    for t in range(1, 5000):
        b = bucket_length(t)
        assert b >= t and b >= MIN_BUCKET
        assert b >= prev  # monotone
        prev = b
        if t > MIN_BUCKET:  # at most one step of next_pow2 / BUCKET_FRACTION extra
            step = max(MIN_BUCKET, (1 << (t - 1).bit_length()) // BUCKET_FRACTION)
            assert b - t < step
            assert b % step == 0
    # few shapes: lengths up to 2048 fall into a few dozen buckets
    assert len({bucket_length(t) for t in range(1, 2049)}) <= 60


def test_graphs_auto_follows_model_size(monkeypatch, model):
    """``auto`` on a CUDA device: graphs for models below AUTO_MAX_PARAMS only (no CUDA
    needed to check the decision)."""
    from prism_select.runtime import graphs
    n = sum(p.numel() for p in model.parameters())
    monkeypatch.setattr(graphs, "AUTO_MAX_PARAMS", n + 1)
    assert graphs_wanted("auto", "cuda", model) is True
    monkeypatch.setattr(graphs, "AUTO_MAX_PARAMS", n)
    assert graphs_wanted("auto", "cuda", model) is False
    assert graphs_wanted("on", "cuda", model) is True


def test_graphs_wanted_modes():
    assert graphs_wanted("auto", "cpu") is False
    assert graphs_wanted("off", "cpu") is False
    with pytest.raises(ConfigError, match="cuda_graphs"):
        graphs_wanted("on", "cpu")
    with pytest.raises(ConfigError, match="cuda_graphs"):
        graphs_wanted("sometimes", "cpu")


def test_padded_bucketed_equals_eager(model, modules, tok, encoded_pool):
    """Rows padded to the graph batch, lengths to the bucket, no attention mask: the
    same scores as the eager unpadded batches (the padding logic the graphs replay)."""
    V = _direction(modules)
    pad = tok.pad_token_id
    eager = make_scorer(model, modules, V, pad_id=pad)
    padded = GraphedScorer(make_scorer(model, modules, V, pad_id=pad),
                           batch_size=4, pad_id=pad, capture=False)
    ref, got = [], []
    for sc, out in ((eager, ref), (padded, got)):
        with sc:
            for i in range(0, len(encoded_pool), 3):  # 3 rows into a 4-row graph batch
                out.append(sc.score(engine.collate_to(encoded_pool[i:i + 3], pad, None)))
    ref, got = torch.cat(ref), torch.cat(got)
    assert got.shape == ref.shape
    assert rel_err(got, ref) <= PAD_RTOL


def test_batch_larger_than_graph_batch_is_refused(model, modules, tok, encoded_pool):
    V = _direction(modules)
    sc = GraphedScorer(make_scorer(model, modules, V, pad_id=tok.pad_token_id), batch_size=2,
                       pad_id=tok.pad_token_id, capture=False)
    with sc, pytest.raises(ValueError, match="exceeds"):
        sc.score(engine.collate_to(encoded_pool[:3], tok.pad_token_id, None))


def test_cpu_auto_is_eager(model, modules, tok):
    V = _direction(modules)
    sc = make_scorer(model, modules, V, pad_id=tok.pad_token_id, batch_size=4,
                     execution=ExecutionContext.of(model, cuda_graphs="auto"))
    assert not isinstance(sc, GraphedScorer)


# ----------------------------------------------------------------------------- GPU

@pytest.fixture
def gpu_model(tok):
    m = tiny_llama(len(tok), dtype=torch.float32, layers=2).cuda().eval()
    return m


@needs_cuda
def test_graphs_match_eager_on_gpu(gpu_model, tok, encoded_pool):
    from prism_select.model import tracked_linear_modules
    modules = tracked_linear_modules(gpu_model, None)
    V = {k: v.cuda() for k, v in _direction(modules, dtype=torch.float32).items()}
    kw = dict(pad_id=tok.pad_token_id, batch_size=3)
    eager = score_encoded(gpu_model, modules, encoded_pool, V,
                          execution=ExecutionContext.of(gpu_model, cuda_graphs="off", progress=False), **kw)
    graphed = score_encoded(gpu_model, modules, encoded_pool, V,
                            execution=ExecutionContext.of(gpu_model, cuda_graphs="on", progress=False), **kw)
    again = score_encoded(gpu_model, modules, encoded_pool, V,
                          execution=ExecutionContext.of(gpu_model, cuda_graphs="on", progress=False), **kw)
    assert rel_err(graphed, eager) <= GPU_F32_RTOL
    assert torch.equal(graphed, again)  # replay is deterministic


@needs_cuda
def test_stacked_directions_graphed_match_one_by_one_on_gpu(gpu_model, tok, encoded_pool):
    """score_directions under CUDA graphs (several directions from one pass) against each
    direction scored on its own, eagerly."""
    from prism_select.model import tracked_linear_modules
    from prism_select.scoring import score_directions
    modules = tracked_linear_modules(gpu_model, None)
    Vs = [{k: v.cuda() for k, v in _direction(modules, seed, dtype=torch.float32).items()} for seed in (1, 2, 3)]
    kw = dict(pad_id=tok.pad_token_id, batch_size=3)
    eager = ExecutionContext.of(gpu_model, cuda_graphs="off", progress=False)
    one = torch.stack([score_encoded(gpu_model, modules, encoded_pool, V, execution=eager, **kw) for V in Vs], 1)
    got = score_directions(gpu_model, modules, encoded_pool, Vs,
                           execution=ExecutionContext.of(gpu_model, cuda_graphs="on", progress=False), **kw)
    assert got.shape == one.shape and rel_err(got, one) <= GPU_F32_RTOL


@needs_cuda
def test_graph_replays_each_shape_and_counts_captures(gpu_model, tok, encoded_pool):
    from prism_select.model import tracked_linear_modules
    modules = tracked_linear_modules(gpu_model, None)
    V = {k: v.cuda() for k, v in _direction(modules, dtype=torch.float32).items()}
    pad = tok.pad_token_id
    sc = make_scorer(gpu_model, modules, V, pad_id=pad, batch_size=4,
                     execution=ExecutionContext.of(gpu_model, cuda_graphs="on"))
    assert isinstance(sc, GraphedScorer)
    batches = [engine.collate_to(encoded_pool[i:i + 2], pad, "cuda") for i in range(0, len(encoded_pool), 2)]
    # the same rows in the other order: the same padded shape (so the same graph) with other
    # data, which a replay must copy in before it runs
    swapped = [engine.collate_to(encoded_pool[i:i + 2][::-1], pad, "cuda") for i in range(0, len(encoded_pool), 2)]
    with sc:
        first = [sc.score(b) for b in batches]
        second = [sc.score(b) for b in batches]
        turned = [sc.score(b) for b in swapped]
        shapes = {bucket_length(b["input_ids"].shape[1]) for b in batches}
        assert sc.captures == len(shapes) and sc.failed is None
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    eager = make_scorer(gpu_model, modules, V, pad_id=pad, batch_size=4,
                        execution=ExecutionContext.of(gpu_model, cuda_graphs="off"))
    with eager:
        want = [eager.score(b) for b in batches]
    for got, ref, back in zip(first, want, turned):
        assert rel_err(got, ref) <= GPU_F32_RTOL
        assert rel_err(back, ref.flip(0)) <= GPU_F32_RTOL


@needs_cuda
def test_failed_capture_falls_back_to_eager(gpu_model, tok, encoded_pool):
    class HostReader:  # reads a value on the host mid-step: not capturable
        def __init__(self, inner):
            self.inner = inner

        def score(self, batch):
            out = self.inner.score(batch)
            if float(out.sum()) != float(out.sum()):  # a host sync
                raise AssertionError
            return out

    from prism_select.model import tracked_linear_modules
    modules = tracked_linear_modules(gpu_model, None)
    V = {k: v.cuda() for k, v in _direction(modules, dtype=torch.float32).items()}
    pad = tok.pad_token_id
    inner = engine.ExactScorer(gpu_model, modules, V)
    sc = GraphedScorer(HostReader(inner), batch_size=4, pad_id=pad)
    b = engine.collate_to(encoded_pool[:3], pad, "cuda")
    with inner, sc:
        got = sc.score(b)
        ref = inner.score(b)
    assert sc.failed is not None
    assert rel_err(got, ref) <= GPU_F32_RTOL


def _stand_in_cuda(monkeypatch, state: dict, **calls) -> None:
    """torch.cuda's stream, graph and cache calls stood in for on the CPU: ``state["capturing"]``
    is True inside a capture; ``calls`` replaces any of them (e.g. ``empty_cache``)."""
    import contextlib

    class Stream:
        def wait_stream(self, other):
            pass

    class Graph:
        def replay(self):
            pass

    @contextlib.contextmanager
    def graph(g, pool=None):
        state["capturing"] = True
        try:
            yield
        finally:
            state["capturing"] = False

    stand_ins = {"Stream": Stream, "current_stream": Stream, "stream": lambda s: contextlib.nullcontext(),
                 "synchronize": lambda: None, "empty_cache": lambda: None, "graph_pool_handle": object,
                 "CUDAGraph": Graph, "graph": graph, "memory_reserved": lambda device=None: 0}
    for name, value in {**stand_ins, **calls}.items():
        monkeypatch.setattr(torch.cuda, name, value)


def test_a_failed_capture_frees_its_memory_before_the_eager_steps(monkeypatch):
    """A capture that fails mid-graph leaves nothing of it alive (its inputs, graph and
    pool are unreachable at once, not at the next garbage collection), and the cached
    blocks are handed back before the capture and after the failure, so that under a
    memory cap the eager fallback finds the memory the capture held. Driven on the CPU
    with the CUDA calls stood in for."""
    import gc
    import weakref

    calls = []
    state = {"capturing": False}
    _stand_in_cuda(monkeypatch, state, empty_cache=lambda: calls.append("empty_cache"))
    monkeypatch.setattr("prism_select.runtime.memory.device_headroom", lambda device: 2**40)
    seen = []

    class Scorer:
        def score(self, batch):
            if state["capturing"]:
                seen.append(weakref.ref(batch["input_ids"]))
                raise RuntimeError("operation not permitted when stream is capturing")
            return batch["input_ids"].sum(1).float()

    sc = GraphedScorer(Scorer(), batch_size=4, pad_id=0)
    ids = torch.arange(1, 7).reshape(2, 3)
    b = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
    gc.disable()
    try:
        got = sc.score(b)
        assert seen and seen[0]() is None  # the padded capture input died with the failure
    finally:
        gc.enable()
    assert sc.failed.startswith("RuntimeError: operation not permitted")
    assert sc.pool is None and not sc.graphs and sc.captures == 0
    # before the warm-up, before the capture, and after its failure
    assert calls == ["empty_cache", "empty_cache", "empty_cache"]
    assert torch.equal(got, ids.sum(1).float())


def test_a_shape_whose_capture_may_not_fit_runs_eagerly_and_the_others_keep_their_graphs(monkeypatch):
    """A capture is tried only where the process may still reserve CAPTURE_HEADROOM times
    what the shape's eager warm-up reserved: a longer shape that would not fit runs eagerly
    (no capture tried, now or later), and the shorter shape captured before keeps its
    graph. Driven on the CPU with the CUDA calls stood in for (memory counted by the stub)."""
    from prism_select.runtime.graphs import CAPTURE_HEADROOM

    state = {"reserved": 0, "capturing": False}
    per_token = 1000  # bytes a warm-up step reserves per padded token
    _stand_in_cuda(monkeypatch, state, empty_cache=lambda: state.update(reserved=0),
                   memory_reserved=lambda device=None: state["reserved"])
    # room for a 16-token shape's capture (4 x 16 tokens), not for a 64-token one's
    room = int(CAPTURE_HEADROOM * per_token * 4 * 40)
    monkeypatch.setattr("prism_select.runtime.memory.device_headroom", lambda device: room)
    captured = []

    class Scorer:
        def score(self, batch):
            ids = batch["input_ids"]
            if state["capturing"]:
                captured.append(ids.shape[1])
            else:
                state["reserved"] += per_token * ids.numel()
            return ids.sum(1).float()

    sc = GraphedScorer(Scorer(), batch_size=4, pad_id=0)

    def batch(t):
        ids = torch.arange(1, 2 * t + 1).reshape(2, t)
        return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}

    short, long_ = batch(5), batch(60)
    assert torch.equal(sc.score(short), short["input_ids"].sum(1).float())
    assert torch.equal(sc.score(long_), long_["input_ids"].sum(1).float())
    assert torch.equal(sc.score(long_), long_["input_ids"].sum(1).float())
    assert captured == [16]  # the short shape only, once
    assert set(sc.graphs) == {16} and sc.eager == {64} and sc.captures == 1 and sc.failed is None


# ----------------------------------------------------------------------------- curvature fit

def test_fit_through_padded_graph_path_equals_plain_fit(monkeypatch, model, modules, tok, encoded_pool):
    """The fit's graph path (padded rows and lengths, no attention mask, plain loss,
    token_mask counting tokens) gives the same factors and eigenvalues (float64, CPU:
    the padding logic without capture)."""
    import functools

    from prism_select.curvature import CurvatureSettings, fit_curvature
    from prism_select.curvature import fit as fit_mod
    settings = CurvatureSettings(kind="ekfac", damping=1e-3, batch_size=4)
    ref = fit_curvature(model, modules, encoded_pool, settings, pad_id=tok.pad_token_id)
    used = []

    def padded(*a, **k):
        used.append(1)
        return GraphedScorer(*a, **k, capture=False)

    monkeypatch.setattr(fit_mod, "graphs_wanted", lambda mode, dev, model=None: True)
    monkeypatch.setattr(fit_mod, "GraphedScorer", functools.partial(padded))
    monkeypatch.setattr(spill_mod, "SPILL_MAX_BYTES", 0)  # the CPU's spill would spare the second pass
    got = fit_curvature(model, modules, encoded_pool, settings, pad_id=tok.pad_token_id,
                        execution=ExecutionContext.of(model, cuda_graphs="on"))
    assert len(used) == 2  # both passes went through the padded path
    for k, t in ref.tensors.items():
        if k.endswith(("::QA", "::QS")):
            continue  # eigenvectors (signs/rotations in degenerate spaces) checked through use
        assert torch.allclose(got.tensors[k], t, rtol=1e-9, atol=1e-12), k
    g = {n: torch.randn(m.weight.shape, dtype=torch.float64) for n, m in modules.items()}
    a, b = ref.precondition(g), got.precondition(g)
    assert max(rel_err(b[n], a[n]) for n in modules) <= 1e-8


def test_fit_warmup_batch_adds_nothing(model, modules, tok, encoded_pool):
    """The graph warm-up runs the fit step on ``neutral`` batches: no statistics move."""
    from prism_select.curvature import fit as fit_mod
    from prism_select.engine import tap_linears
    from prism_select.runtime.graphs import pad_batch
    from prism_select.runtime.layers import layer_shape
    stats = stats_mod._Stats(torch.float64)
    A = {n: torch.zeros(layer_shape(m)[1], layer_shape(m)[1], dtype=torch.float64) for n, m in modules.items()}
    S = {n: torch.zeros(layer_shape(m)[0], layer_shape(m)[0], dtype=torch.float64) for n, m in modules.items()}
    taps = {n: factors_mod._CovTap(m, stats, A[n], S[n]) for n, m in modules.items()}
    step = fit_mod._FitStep(model, stats, "empirical", 0, None)
    b = pad_batch(engine.collate_to(encoded_pool[:3], tok.pad_token_id, None), 4, 64, tok.pad_token_id)
    with tap_linears(model, taps):
        step.score(step.neutral(b))
        assert float(stats.n_tokens) == 0
        assert all(float(t.abs().sum()) == 0 for t in list(A.values()) + list(S.values()))
        step.score(b)  # and the real batch does add
        assert float(stats.n_tokens) == sum(len(e.input_ids) for e in encoded_pool[:3])
        assert all(float(t.abs().sum()) > 0 for t in list(A.values()) + list(S.values()))


@needs_cuda
def test_graphed_fit_matches_eager_on_gpu(gpu_model, tok, encoded_pool):
    from prism_select.curvature import CurvatureSettings, fit_curvature
    from prism_select.model import tracked_linear_modules
    modules = tracked_linear_modules(gpu_model, None)
    settings = CurvatureSettings(kind="ekfac", damping=1e-3, batch_size=3)
    ex = dict(device="cuda", progress=False)
    eager = fit_curvature(gpu_model, modules, encoded_pool, settings, pad_id=tok.pad_token_id,
                          execution=ExecutionContext.of(gpu_model, cuda_graphs="off", **ex))
    graphed = fit_curvature(gpu_model, modules, encoded_pool, settings, pad_id=tok.pad_token_id,
                            execution=ExecutionContext.of(gpu_model, cuda_graphs="on", **ex))
    for k, t in eager.tensors.items():
        if k.endswith(("::QA", "::QS")):
            continue
        assert rel_err(graphed.tensors[k].double(), t.double()) <= GPU_F32_RTOL, k
    g = {n: torch.randn(m.weight.shape, device="cuda") for n, m in modules.items()}
    a, b = eager.precondition(g), graphed.precondition(g)
    assert max(rel_err(b[n].double(), a[n].double()) for n in modules) <= 1e-3


@needs_cuda
def test_mm_acc_into_accumulates_in_place_on_gpu():
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(64, 40, device="cuda", generator=g).to(torch.bfloat16)
    M = torch.randn(40, 40, device="cuda", generator=g)
    ref = M + a.float().T @ a.float()
    ptr = M.data_ptr()
    from prism_select.engine import mm_acc_into
    out = mm_acc_into(M, a.T, a)
    assert out.data_ptr() == ptr and M.data_ptr() == ptr
    assert rel_err(M.double(), ref.double()) <= 1e-5


def test_fit_graphs_pay_off_needs_replays_per_shape(tok, encoded_pool):
    from prism_select.curvature.fit import FIT_GRAPH_MIN_REPLAYS, fit_graphs_pay_off
    same = [[0]] * FIT_GRAPH_MIN_REPLAYS  # one shape, replayed often enough
    assert fit_graphs_pay_off(encoded_pool, same)
    assert not fit_graphs_pay_off(encoded_pool, same[:-1])
    lengths = {bucket_length(len(e.input_ids)) for e in encoded_pool}
    varied = [[i] for i in range(len(encoded_pool))] * FIT_GRAPH_MIN_REPLAYS
    assert fit_graphs_pay_off(encoded_pool, varied) == (len(varied) >= FIT_GRAPH_MIN_REPLAYS * len(lengths))
    assert not fit_graphs_pay_off(encoded_pool, [[i] for i in range(len(encoded_pool))])


def test_a_capture_out_of_memory_turns_later_captures_off_and_names_the_fix(monkeypatch, tmp_path):
    """After a capture ran out of memory, the process's later scorers run eagerly (no new
    capture, whose pool could not be given back either), and an out-of-memory error names
    --cuda-graphs off instead of a lower cap. CUDA calls stood in for on the CPU."""
    from prism_select import errors
    from prism_select.runtime import graphs
    from prism_select.errors import resource_error

    monkeypatch.setattr(errors, "CAPTURE_OOM", [])
    state = {"capturing": False}
    _stand_in_cuda(monkeypatch, state)
    monkeypatch.setattr("prism_select.runtime.memory.device_headroom", lambda device: 2**40)
    tries = []

    class Scorer:
        def score(self, batch):
            if state["capturing"]:
                tries.append(1)
                raise RuntimeError("CUDA out of memory. Tried to allocate 1.31 GiB")
            return batch["input_ids"].sum(1).float()

    ids = torch.arange(1, 7).reshape(2, 3)
    b = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
    plain = resource_error(RuntimeError("CUDA out of memory. Tried to allocate 2 MiB"), tmp_path)
    assert "--max-gpu-memory" in str(plain) and "--cuda-graphs off" not in str(plain)
    first = GraphedScorer(Scorer(), batch_size=4, pad_id=0)
    assert torch.equal(first.score(b), ids.sum(1).float())
    assert graphs.capture_out_of_memory().startswith("RuntimeError: CUDA out of memory")
    later = GraphedScorer(Scorer(), batch_size=4, pad_id=0)
    assert torch.equal(later.score(b), ids.sum(1).float())
    assert tries == [1] and later.captures == 0  # the later scorer tried no capture
    err = resource_error(RuntimeError("CUDA out of memory. Tried to allocate 2 MiB"), tmp_path)
    assert "--cuda-graphs off" in str(err)
