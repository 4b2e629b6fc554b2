"""CUDA-graph scoring (prism_select/graphs.py): bucketing and padding on the CPU in
float64 against unpadded eager scores; capture and replay against eager on a GPU."""

import pytest
import torch

from prism_select import fast
from prism_select.data.tokenize import encode
from prism_select.errors import ConfigError
from prism_select.graphs import BUCKET_FRACTION, MIN_BUCKET, GraphedScorer, bucket_length, graphs_wanted
from prism_select.scoring import make_scorer, score_encoded

from tiny import tiny_llama

#: padded + bucketed vs unpadded eager scores, float64 CPU (same math, other padding);
#: finite differences divide float64 rounding by their step (1e-6 here)
PAD_RTOL = {"exact": 1e-10, "fd": 1e-8}
#: captured graph vs eager on the GPU in float32 (kernel choice may differ: sdpa causal
#: kernel in both, but cuBLAS may pick other algorithms for the padded shapes); finite
#: differences divide that rounding by their step (1e-3 here)
GPU_F32_RTOL = {"exact": 1e-4, "fd": 1e-3}

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


def test_graphs_wanted_modes():
    assert graphs_wanted("auto", "cpu") is False
    assert graphs_wanted("off", "cpu") is False
    with pytest.raises(ConfigError, match="cuda_graphs"):
        graphs_wanted("on", "cpu")
    with pytest.raises(ConfigError, match="cuda_graphs"):
        graphs_wanted("sometimes", "cpu")


@pytest.mark.parametrize("scoring", ["exact", "fd"])
def test_padded_bucketed_equals_eager(model, modules, tok, encoded_pool, scoring):
    """Rows padded to the graph batch, lengths to the bucket, no attention mask: the
    same scores as the eager unpadded batches (the padding logic the graphs replay)."""
    V = _direction(modules)
    pad = tok.pad_token_id
    eager = make_scorer(model, modules, V, scoring=scoring, pad_id=pad, fd_eps=1e-6)
    padded = GraphedScorer(make_scorer(model, modules, V, scoring=scoring, pad_id=pad, fd_eps=1e-6),
                           batch_size=4, pad_id=pad, capture=False)
    ref, got = [], []
    for sc, out in ((eager, ref), (padded, got)):
        with sc:
            for i in range(0, len(encoded_pool), 3):  # 3 rows into a 4-row graph batch
                out.append(sc.score(fast.collate_to(encoded_pool[i:i + 3], pad, None)))
    ref, got = torch.cat(ref), torch.cat(got)
    assert got.shape == ref.shape
    assert rel_err(got, ref) <= PAD_RTOL[scoring]


def test_batch_larger_than_graph_batch_is_refused(model, modules, tok, encoded_pool):
    V = _direction(modules)
    sc = GraphedScorer(make_scorer(model, modules, V, pad_id=tok.pad_token_id), batch_size=2,
                       pad_id=tok.pad_token_id, capture=False)
    with sc, pytest.raises(ValueError, match="exceeds"):
        sc.score(fast.collate_to(encoded_pool[:3], tok.pad_token_id, None))


def test_cpu_auto_is_eager(model, modules, tok):
    V = _direction(modules)
    sc = make_scorer(model, modules, V, pad_id=tok.pad_token_id, cuda_graphs="auto", batch_size=4)
    assert not isinstance(sc, GraphedScorer)


# ----------------------------------------------------------------------------- GPU

@pytest.fixture
def gpu_model(tok):
    m = tiny_llama(len(tok), dtype=torch.float32, layers=2).cuda().eval()
    return m


@needs_cuda
@pytest.mark.parametrize("scoring", ["exact", "fd"])
def test_graphs_match_eager_on_gpu(gpu_model, tok, encoded_pool, scoring):
    from prism_select.model import tracked_linear_modules
    modules = tracked_linear_modules(gpu_model, None)
    V = {k: v.cuda() for k, v in _direction(modules, dtype=torch.float32).items()}
    kw = dict(pad_id=tok.pad_token_id, batch_size=3, progress=False, scoring=scoring, fd_eps=1e-3)
    eager = score_encoded(gpu_model, modules, encoded_pool, V, cuda_graphs="off", **kw)
    graphed = score_encoded(gpu_model, modules, encoded_pool, V, cuda_graphs="on", **kw)
    again = score_encoded(gpu_model, modules, encoded_pool, V, cuda_graphs="on", **kw)
    assert rel_err(graphed, eager) <= GPU_F32_RTOL[scoring]
    assert torch.equal(graphed, again)  # replay is deterministic


@needs_cuda
def test_graph_replays_each_shape_and_counts_captures(gpu_model, tok, encoded_pool):
    from prism_select.model import tracked_linear_modules
    modules = tracked_linear_modules(gpu_model, None)
    V = {k: v.cuda() for k, v in _direction(modules, dtype=torch.float32).items()}
    pad = tok.pad_token_id
    sc = make_scorer(gpu_model, modules, V, pad_id=pad, cuda_graphs="on", batch_size=4)
    assert isinstance(sc, GraphedScorer)
    batches = [fast.collate_to(encoded_pool[i:i + 2], pad, "cuda") for i in range(0, len(encoded_pool), 2)]
    with sc:
        first = [sc.score(b) for b in batches]
        second = [sc.score(b) for b in batches]
        shapes = {bucket_length(b["input_ids"].shape[1]) for b in batches}
        assert sc.captures == len(shapes) and sc.failed is None
    for a, b in zip(first, second):
        assert torch.equal(a, b)


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
    inner = fast.ExactScorer(gpu_model, modules, V)
    sc = GraphedScorer(HostReader(inner), batch_size=4, pad_id=pad)
    b = fast.collate_to(encoded_pool[:3], pad, "cuda")
    with inner, sc:
        got = sc.score(b)
        ref = inner.score(b)
    assert sc.failed is not None
    assert rel_err(got, ref) <= GPU_F32_RTOL["exact"]
