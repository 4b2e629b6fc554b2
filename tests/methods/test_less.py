"""LESS against a step-by-step float64 reference on a tiny Llama with hand-made checkpoints."""

import dataclasses
import itertools
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from prism_select.runtime import memory
from prism_select.curvature import CurvatureSettings
from prism_select.data.records import PoolExample, TargetPair
from prism_select.data.tokenize import encode
from prism_select.errors import ConfigError, InputError
from prism_select.model import LoadedModel, ModelSettings, model_fingerprint
from prism_select.run import Inputs, RunContext
from prism_select.settings import ScoreSettings

from conftest import PAIRS, POOL
from reference import example_loss
from tiny import tiny_llama, tiny_tokenizer

from prism_select.methods import get, names
from prism_select.methods.less import method as less_method
from prism_select.methods.less import projection as less_proj
from prism_select.methods.less import warmup as less_warmup

LESS = get("less").fn
TASKS = ["a", "a", "b"]


@pytest.fixture(autouse=True)
def _env(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("PRISM_SELECT_CACHE", str(tmp_path / "cache"))


def make_ctx(tmp_path, options, dtype=torch.float64, out="run", batch_size=3, tasks=TASKS, model=None, tok=None,
             records=POOL):
    tok = tok or tiny_tokenizer()
    model = model if model is not None else tiny_llama(len(tok), dtype=dtype)
    lm = LoadedModel(model, tok, ModelSettings("tiny", device="cpu", cache_dir=str(tmp_path / "cache")),
                     model_fingerprint(model), {})
    pool = [PoolExample(i, p, r, i) for i, (p, r) in enumerate(records)]
    pairs = [TargetPair(f"t{j}", q, c, r, j, tasks[j]) for j, (q, c, r) in enumerate(PAIRS)]
    inputs = Inputs(pool=pool, encoded=[encode(tok, e.prompt, e.response) for e in pool], pairs=pairs,
                    chosen=[encode(tok, p.prompt, p.chosen) for p in pairs],
                    rejected=[encode(tok, p.prompt, p.rejected) for p in pairs], invalid=[],
                    truncated={"pool": 0, "targets": 0})
    settings = ScoreSettings(method="prism", batch_size=batch_size, progress=False, method_options=options)
    return RunContext(lm, {}, inputs, settings, CurvatureSettings(), Path(tmp_path / out))


def make_checkpoint(d, seed, mean_lr, targets=("q_proj", "v_proj")):
    """An adapter with random LoRA weights and a random Adam state (no training)."""
    from peft import LoraConfig, get_peft_model
    from prism_select.finetune import adapter_param_key

    tok = tiny_tokenizer()
    pm = get_peft_model(tiny_llama(len(tok)), LoraConfig(r=2, lora_alpha=4, target_modules=list(targets)))
    g = torch.Generator().manual_seed(seed)
    state = {}
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
                k = adapter_param_key(n)
                state[f"exp_avg.{k}"] = torch.randn(p.shape, generator=g, dtype=torch.float32) * 1e-2
                state[f"exp_avg_sq.{k}"] = torch.rand(p.shape, generator=g, dtype=torch.float32) * 1e-4
    pm.save_pretrained(str(d))
    save_file(state, str(d / "optimizer.safetensors"))
    (d / "checkpoint.json").write_text(json.dumps({"epoch": 1, "mean_lr": mean_lr}))
    return state


def reference_scores(ckpts, weights, dim, proj_seed, tasks, side="chosen", projection="sjlt"):
    """Step by step: autograd per-example grads, LESS's Adam formula, explicit P, cosines.
    ``projection``: the matrix (``sjlt``, what ``auto`` picks on the CPU, or ``rademacher``)."""
    from peft import PeftModel
    from safetensors.torch import load_file

    tok = tiny_tokenizer()
    pool = [encode(tok, p, r) for p, r in POOL]
    targets = [encode(tok, q, c if side == "chosen" else r) for q, c, r in PAIRS]
    sim = torch.zeros(len(pool), len(targets), dtype=torch.float64)
    for ckpt, w in zip(ckpts, weights):
        pm = PeftModel.from_pretrained(tiny_llama(len(tok)), str(ckpt)).eval()
        named = [(n, p) for n, p in pm.named_parameters() if "lora_" in n]
        keys = [n.replace(".default.", ".") for n, _ in named]
        params = [p for _, p in named]
        for p in params:
            p.requires_grad_(True)
        st = load_file(str(ckpt / "optimizer.safetensors"))
        P = less_proj.projection_matrix({k: p.numel() for k, p in zip(keys, params)}, dim, proj_seed,
                                       kind=projection)
        if projection == "rademacher":
            assert set(P.unique().tolist()) == {-1.0, 1.0}

        def grad(e):
            gs = torch.autograd.grad(example_loss(pm, e, mean=True), params)
            return [g.reshape(-1) for g in gs]

        cand = []
        for e in pool:
            gam = []
            for k, g in zip(keys, grad(e)):
                m = st[f"exp_avg.{k}"].double().reshape(-1)
                v = st[f"exp_avg_sq.{k}"].double().reshape(-1)
                m2 = 0.9 * m + 0.1 * g
                v2 = 0.999 * v + 0.001 * g ** 2
                gam.append(m2 / torch.sqrt(v2 + 1e-8))
            cand.append(torch.cat(gam) @ P)
        targ = [torch.cat(grad(e)) @ P for e in targets]
        C = torch.stack(cand)
        T = torch.stack(targ)
        C = C / C.norm(dim=1, keepdim=True)
        T = T / T.norm(dim=1, keepdim=True)
        sim += w * (C @ T.T)
    names = list(dict.fromkeys(tasks))
    per_task = torch.stack([sim[:, [j for j, t in enumerate(tasks) if t == n]].mean(1) for n in names], 1)
    return per_task.max(1).values, sim


@pytest.fixture
def two_checkpoints(tmp_path):
    ck = [tmp_path / "ck1", tmp_path / "ck2"]
    make_checkpoint(ck[0], 1, 3e-5)
    make_checkpoint(ck[1], 2, 1e-5)
    return ck


@pytest.mark.parametrize("projection", ["rademacher", "sjlt"])
def test_less_equals_the_step_by_step_computation(tmp_path, two_checkpoints, projection):
    ck = two_checkpoints
    ctx = make_ctx(tmp_path, {"checkpoints": [str(c) for c in ck], "proj_dim": 16, "proj_seed": 7,
                              "proj_chunk": 5, "projection": projection})
    fp = ctx.lm.fingerprint
    scores, rows = LESS(ctx)
    ref, sim = reference_scores(ck, [0.75, 0.25], 16, 7, TASKS, projection=projection)
    assert scores.dtype == torch.float64
    torch.testing.assert_close(scores, ref, rtol=1e-9, atol=1e-12)
    # max over tasks of the mean over each task's targets
    torch.testing.assert_close(ref, torch.maximum(sim[:, :2].mean(1), sim[:, 2]))
    assert (sim[:, :2].mean(1) != sim[:, 2]).all()
    info = ctx.info["method"]
    assert info["name"] == "less" and info["checkpoint_weights"] == pytest.approx([0.75, 0.25])
    assert info["checkpoint_weight_source"] == "mean_lr" and info["options"]["proj_dim"] == 16
    assert info["projection"] == projection and info["projection_reason"] == "option projection"
    assert [r["id"] for r in rows] == ["t0", "t1", "t2"] and rows[0]["task"] == "a"
    # the run's model is untouched (adapters loaded and removed again)
    assert model_fingerprint(ctx.lm.model) == fp and not hasattr(ctx.lm.model, "peft_config")
    # batching, chunking and resumed features do not change the numbers
    ctx2 = make_ctx(tmp_path, {"checkpoints": [str(c) for c in ck], "proj_dim": 16, "proj_seed": 7,
                               "proj_chunk": 2, "projection": projection}, batch_size=1, out="run2")
    s2 = LESS(ctx2)[0]
    torch.testing.assert_close(s2, scores, rtol=1e-12, atol=1e-14)
    assert (tmp_path / "run2" / ".partial" / "less" / "ckpt-1.safetensors").is_file()
    torch.testing.assert_close(LESS(ctx2)[0], s2, rtol=0, atol=0)  # read back from .partial
    # resumed with the other projection (`auto` on another device): recomputed, not reused
    other = {"rademacher": "sjlt", "sjlt": "rademacher"}[projection]
    ctx2.settings.method_options = {**ctx2.settings.method_options, "projection": other}
    ref2, _ = reference_scores(ck, [0.75, 0.25], 16, 7, TASKS, projection=other)
    torch.testing.assert_close(LESS(ctx2)[0], ref2, rtol=1e-9, atol=1e-12)


def test_checkpoint_of_weight_zero_is_not_computed(tmp_path, two_checkpoints):
    ck = two_checkpoints
    ctx = make_ctx(tmp_path, {"checkpoints": [str(c) for c in ck], "proj_dim": 16, "proj_seed": 7,
                              "projection": "sjlt", "checkpoint_weights": [0, 2]})
    scores = LESS(ctx)[0]
    ref, _ = reference_scores(ck, [0.0, 1.0], 16, 7, TASKS, projection="sjlt")
    torch.testing.assert_close(scores, ref, rtol=1e-9, atol=1e-12)
    assert ctx.info["method"]["skipped_checkpoints"] == [0]
    partial = tmp_path / "run" / ".partial" / "less"
    assert not (partial / "ckpt-0.safetensors").exists() and (partial / "ckpt-1.safetensors").is_file()


@pytest.mark.parametrize("projection,cap", [("rademacher", "GRAD_CHUNK_BYTES"), ("sjlt", "SJLT_CHUNK_BYTES")])
def test_gradient_chunk_is_bounded_in_bytes(tmp_path, two_checkpoints, monkeypatch, projection, cap):
    """A chunk whose flattened gradients would pass GRAD_CHUNK_BYTES (SJLT_CHUNK_BYTES) is
    projected a few examples at a time: same scores (the 64-example default held 3.8 GB at 135M)."""
    ck = two_checkpoints
    opts = {"checkpoints": [str(c) for c in ck], "proj_dim": 16, "proj_seed": 7, "proj_chunk": 64,
            "projection": projection}
    ref = LESS(make_ctx(tmp_path, opts))[0]
    seen = []
    project = less_proj.project
    monkeypatch.setattr(less_proj, "project", lambda flat, *a: (seen.append(flat.shape[0]), project(flat, *a))[1])
    monkeypatch.setattr(less_proj, cap, 1)
    got = LESS(make_ctx(tmp_path, opts, out="run2"))[0]
    assert seen and max(seen) == 1
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-14)


def _fake_cuda(monkeypatch, free_gib: int, reserved_gib: int = 0, allocated_gib: int = 0, total_gib: int = 140):
    """The CUDA memory queries of one 140 GiB device, faked so the test runs without one."""
    class Props:
        total_memory = total_gib << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free_gib << 30, total_gib << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved_gib << 30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated_gib << 30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: Props())


def test_chunk_bound_grows_with_the_free_gpu_memory(monkeypatch):
    cuda = torch.device("cuda", 0)
    assert less_proj.chunk_bytes(torch.device("cpu"), "rademacher") == (less_proj.GRAD_CHUNK_BYTES, "GRAD_CHUNK_BYTES")
    assert less_proj.chunk_bytes(cuda, "sjlt")[0] == less_proj.SJLT_CHUNK_BYTES
    monkeypatch.setattr(memory, "_CAPS", {})
    _fake_cuda(monkeypatch, free_gib=100)
    cap, name = less_proj.chunk_bytes(cuda, "rademacher")
    assert cap == 25 << 30 and "memory this process can allocate" in name
    # the allocator's own unused cache counts as room
    _fake_cuda(monkeypatch, free_gib=96, reserved_gib=6, allocated_gib=2)
    assert less_proj.chunk_bytes(cuda, "rademacher")[0] == 25 << 30
    # a busy GPU keeps the fixed bound
    _fake_cuda(monkeypatch, free_gib=2)
    assert less_proj.chunk_bytes(cuda, "rademacher") == (less_proj.GRAD_CHUNK_BYTES, "GRAD_CHUNK_BYTES")


def test_chunk_bound_stays_within_the_processs_gpu_memory_cap(monkeypatch):
    """Processes sharing one GPU under ``max_gpu_memory`` caps: a chunk sized by the
    device's free memory (100 GiB free: 25 GiB) would overrun an 8 GiB cap; it is sized by
    what the cap leaves (8 GiB less 3 GiB in use: a quarter of 5 GiB)."""
    cuda = torch.device("cuda", 0)
    _fake_cuda(monkeypatch, free_gib=100, reserved_gib=3, allocated_gib=3)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda fraction, device=None: None)
    monkeypatch.setattr(memory, "_CAPS", {})
    memory.cap_device_memory(cuda, 8 << 30)
    cap, _ = less_proj.chunk_bytes(cuda, "rademacher")
    assert cap == (5 << 30) // 4
    # a cap that leaves less than a quarter of the fixed bound's worth keeps the fixed bound
    memory.cap_device_memory(cuda, 4 << 30)
    assert less_proj.chunk_bytes(cuda, "rademacher") == (less_proj.GRAD_CHUNK_BYTES, "GRAD_CHUNK_BYTES")


def test_less_hands_the_heap_back_after_each_chunk_and_checkpoint(tmp_path, two_checkpoints, monkeypatch):
    """On the CPU the heap is trimmed after each projected chunk (its freed per-example
    gradients) and after each checkpoint (its adapter, Adam state and features): untrimmed,
    a 1,000-record `compare` crept ~60 MiB a checkpoint. The scores stay the same."""
    ck = two_checkpoints
    opts = {"checkpoints": [str(c) for c in ck], "proj_dim": 16, "proj_seed": 7, "proj_chunk": 2,
            "projection": "sjlt"}
    ref = LESS(make_ctx(tmp_path, opts))[0]
    events = []
    project = less_proj.project
    monkeypatch.setattr(less_proj, "project", lambda flat, *a: (events.append("chunk"), project(flat, *a))[1])
    for mod in (less_proj, less_method):  # after each chunk (projection), after each checkpoint (method)
        monkeypatch.setattr(mod, "release_host_memory", lambda *device: events.append("trim"))
    got = LESS(make_ctx(tmp_path, opts, out="run2"))[0]
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    # every chunk's layers are projected, then trimmed; each checkpoint ends with one more trim
    chunks = [len(list(g)) for k, g in itertools.groupby(events) if k == "chunk"]
    trims = [len(list(g)) for k, g in itertools.groupby(events) if k == "trim"]
    n_pool, n_targets = len(POOL), len(PAIRS)
    per_ckpt = -(-n_pool // 2) + -(-n_targets // 2)  # chunks of 2 examples: candidates, then targets
    assert len(chunks) == len(ck) * per_ckpt and len(set(chunks)) == 1
    assert sum(trims) == len(ck) * (per_ckpt + 1) and events[-2:] == ["trim", "trim"]


def test_one_task_and_rejected_side(tmp_path, two_checkpoints):
    ck = two_checkpoints
    opts = {"checkpoints": [str(c) for c in ck], "proj_dim": 16, "proj_seed": 3, "target_side": "rejected",
            "checkpoint_weights": [1, 1]}
    ctx = make_ctx(tmp_path, opts, tasks=[None, None, None])
    scores, _ = LESS(ctx)
    ref, sim = reference_scores(ck, [0.5, 0.5], 16, 3, [None] * 3, side="rejected")
    torch.testing.assert_close(scores, ref, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(ref, sim.mean(1))
    assert ctx.info["method"]["checkpoint_weight_source"] == "option"


def test_rademacher_projection_tiles():
    flat = torch.randn(3, less_proj.TILE_ROWS + 100, dtype=torch.float64)
    P = less_proj.projection_matrix({"k": flat.shape[1]}, 8, 5)
    assert P.shape == (less_proj.TILE_ROWS + 100, 8)
    torch.testing.assert_close(less_proj.project(flat, "k", 8, 5), flat @ P)
    assert not torch.equal(P, less_proj.projection_matrix({"k": flat.shape[1]}, 8, 6))
    assert not torch.equal(P, less_proj.projection_matrix({"other": flat.shape[1]}, 8, 5))
    assert abs(float(P.mean())) < 0.05


SHAPES = {"a.lora_A.weight": (3, 5), "b.lora_B.weight": less_proj.TILE_ROWS + 37, "c.lora_A.weight": 11}


def _stream(flat, dim, proj_seed, kind="sjlt"):
    """``project`` key by key over a flat vector laid out as SHAPES, summed (as LESS does)."""
    out, lo = 0, 0
    for key, shape in SHAPES.items():
        n = shape if isinstance(shape, int) else shape[0] * shape[1]
        out = out + less_proj.project(flat[:, lo:lo + n], key, dim, proj_seed, kind)
        lo += n
    return out


def test_sjlt_matrix_equals_the_streamed_projection():
    """(a) The whole SJLT matrix, built for a tiny shape, is what the tiled scatter applies."""
    P = less_proj.projection_matrix(SHAPES, 24, 5, kind="sjlt")
    n = P.shape[0]
    assert n == 15 + less_proj.TILE_ROWS + 37 + 11
    # every row: SJLT_NNZ entries of +-1/sqrt(s), summed where two land in one bucket (often
    # at d = 24; probability about s/d per row)
    s = less_proj.SJLT_NNZ
    assert ((P != 0).sum(1) <= s).all() and ((P != 0).sum(1) == s).float().mean() > 0.5
    torch.testing.assert_close((P * s ** 0.5).round(), P * s ** 0.5)
    assert (P.abs().sum(1) * s ** 0.5).le(s + 1e-12).all()
    flat = torch.randn(3, n, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_stream(flat, 24, 5), flat @ P, rtol=1e-12, atol=1e-12)
    # a key's rows depend on its name, not its place; other seed or key -> other matrix
    shuffled = dict(reversed(list(SHAPES.items())))
    assert torch.equal(P[:15], less_proj.projection_matrix(shuffled, 24, 5, kind="sjlt")[-15:])
    assert not torch.equal(P[:15], less_proj.projection_matrix({"x": 15}, 24, 5, kind="sjlt"))
    assert not torch.equal(P, less_proj.projection_matrix(SHAPES, 24, 6, kind="sjlt"))
    assert not torch.equal(P, less_proj.projection_matrix(SHAPES, 24, 5, kind="rademacher"))


def test_sjlt_projection_is_independent_of_chunking():
    """(b) Same features whatever rows are projected together, and in float32 as float64."""
    flat = torch.randn(7, less_proj.TILE_ROWS * 2 + 5, dtype=torch.float64,
                       generator=torch.Generator().manual_seed(1))
    whole = less_proj.project(flat, "k", 32, 3, "sjlt")
    for size in (1, 2, 3):
        parts = torch.cat([less_proj.project(flat[i:i + size], "k", 32, 3, "sjlt") for i in range(0, 7, size)])
        torch.testing.assert_close(parts, whole, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(less_proj.project(flat.float(), "k", 32, 3, "sjlt").double(), whole,
                               rtol=1e-5, atol=1e-4)


#: JL test: 12 random vectors of 40,000 coordinates (10 tiles over 3 keys) to d = 4096. The
#: sketched inner products of unit vectors have standard deviation about sqrt(2/d) = 0.022
#: (1/sqrt(d) for orthogonal ones); JL_TOL is about 4.5 of those (the largest error is
#: 0.036-0.052 over proj_seed 0-5 and 11). Dropping a tile (10% of the coordinates), a hash, the
#: random signs or the 1/sqrt(s) scale, or one bucket for all, fails it.
JL_DIM, JL_TOL = 4096, 0.1


def test_sjlt_preserves_inner_products():
    """(c) Johnson-Lindenstrauss: Gram matrices before and after agree within JL_TOL."""
    g = torch.Generator().manual_seed(2)
    sizes = {"p.lora_A.weight": 16384, "q.lora_B.weight": 12000, "r.lora_A.weight": 11616}
    n = sum(sizes.values())
    X = torch.randn(12, n, dtype=torch.float64, generator=g)
    X[6:] = 0.6 * X[:6] + 0.8 * X[6:]  # pairs with cosine near 0.6
    X[3] *= torch.rand(n, generator=g, dtype=torch.float64) ** 4  # a heavy-tailed one
    X[2] = X[2].abs()  # all positive: a projection without random signs fails on it
    X = X / X.norm(dim=1, keepdim=True)
    Y, lo = 0, 0
    for key, k in sizes.items():
        Y = Y + less_proj.project(X[:, lo:lo + k], key, JL_DIM, 11, "sjlt")
        lo += k
    err = (Y @ Y.T - X @ X.T).abs().max()
    assert err < JL_TOL, f"Gram matrix off by {float(err):.3f}"
    cos = torch.nn.functional.normalize(Y, dim=1)
    assert (cos @ cos.T - X @ X.T).abs().max() < JL_TOL
    assert (X @ X.T)[0, 6] > 0.5  # the test has correlated pairs to preserve


def test_auto_projection_by_device(tmp_path, two_checkpoints, caplog):
    """(d) ``auto``: sjlt on the CPU (and MPS), LESS's dense Rademacher on CUDA; logged and recorded."""
    assert less_proj.resolve_projection("auto", torch.device("cpu"))[0] == "sjlt"
    assert less_proj.resolve_projection("auto", torch.device("mps"))[0] == "sjlt"
    assert less_proj.resolve_projection("auto", torch.device("cuda", 0))[0] == "rademacher"
    assert less_proj.resolve_projection("rademacher", torch.device("cpu")) == ("rademacher", "option projection")
    assert less_method.LessOptions().projection == "auto"
    ctx = make_ctx(tmp_path, {"checkpoints": [str(c) for c in two_checkpoints], "proj_dim": 16, "proj_seed": 7})
    with caplog.at_level("INFO", logger=less_method.log.name):
        scores = LESS(ctx)[0]
    info = ctx.info["method"]
    assert info["projection"] == "sjlt" and info["projection_reason"].startswith("auto: cpu")
    assert info["sjlt_nnz"] == less_proj.SJLT_NNZ
    assert any("sjlt projection to 16 dimensions (auto: cpu" in r.getMessage() for r in caplog.records)
    ref, _ = reference_scores(two_checkpoints, [0.75, 0.25], 16, 7, TASKS, projection="sjlt")
    torch.testing.assert_close(scores, ref, rtol=1e-9, atol=1e-12)


def test_warmup_is_trained_cached_and_reused(tmp_path):
    opts = {"warmup_fraction": 0.5, "epochs": 2, "train_batch_size": 2, "grad_accum": 1, "lora_r": 2,
            "lora_alpha": 4, "lr": 1e-3, "target_modules": ["q_proj"], "proj_dim": 8, "warmup_ratio": 0.0}
    ctx = make_ctx(tmp_path, opts, dtype=torch.float32)
    fp = ctx.lm.fingerprint
    s1, _ = LESS(ctx)
    warm = ctx.info["method"]["warmup"]
    assert warm["reused"] is False and warm["n_examples"] == 4
    assert Path(warm["path"]).parent == tmp_path / "cache" / "less"
    from prism_select import cache
    assert cache.owned(warm["path"]) and [e.path for e in cache.entries(tmp_path / "cache")] == [Path(warm["path"])]
    ck = [Path(c) for c in ctx.info["method"]["checkpoints"]]
    assert [c.name for c in ck] == ["epoch-1", "epoch-2"]
    assert all((c / "optimizer.safetensors").is_file() for c in ck)
    w = ctx.info["method"]["checkpoint_weights"]  # mean lr of each epoch: linear decay 1e-3 .. 2.5e-4
    assert w == pytest.approx([(1 + 0.75) / (1 + 0.75 + 0.5 + 0.25), (0.5 + 0.25) / (1 + 0.75 + 0.5 + 0.25)])
    assert model_fingerprint(ctx.lm.model) == fp
    assert torch.isfinite(s1).all()
    # second call (fresh run dir): the cache is reused and gives the same scores
    ctx2 = make_ctx(tmp_path, opts, dtype=torch.float32, out="run2", model=ctx.lm.model, tok=ctx.lm.tokenizer)
    s2, _ = LESS(ctx2)
    assert ctx2.info["method"]["warmup"]["reused"] is True
    assert ctx2.info["method"]["warmup"]["key"] == warm["key"]
    torch.testing.assert_close(s1, s2)
    # the pool's projected gradients were kept beside the checkpoints and read back
    feats = ctx.info["method"]["candidate_features"]
    assert feats["reused_checkpoints"] == [] and ctx2.info["method"]["candidate_features"] == {
        "key": feats["key"], "reused_checkpoints": [0, 1]}
    assert all((c / "features" / f"{feats['key']}.safetensors").is_file() for c in ck)

    def other_targets(out):  # another target set on the same pool: chosen and rejected swapped
        c = make_ctx(tmp_path, opts, dtype=torch.float32, out=out, model=ctx.lm.model, tok=ctx.lm.tokenizer)
        c.inputs.chosen, c.inputs.rejected = c.inputs.rejected, c.inputs.chosen
        return c
    ctx4 = other_targets("run4")
    s4, _ = LESS(ctx4)
    assert ctx4.info["method"]["candidate_features"]["reused_checkpoints"] == [0, 1]
    for c in ck:
        shutil.rmtree(c / "features")
    ctx5 = other_targets("run5")
    s5, _ = LESS(ctx5)  # computed afresh: the same scores
    assert ctx5.info["method"]["candidate_features"]["reused_checkpoints"] == []
    torch.testing.assert_close(s4, s5, rtol=0, atol=0)
    assert not torch.allclose(s4, s1)
    # other settings -> another key, trained afresh
    ctx3 = make_ctx(tmp_path, {**opts, "lr": 2e-3}, dtype=torch.float32, out="run3", model=ctx.lm.model,
                    tok=ctx.lm.tokenizer)
    LESS(ctx3)
    assert ctx3.info["method"]["warmup"]["reused"] is False
    assert ctx3.info["method"]["warmup"]["key"] != warm["key"]


def test_option_errors(tmp_path, two_checkpoints):
    with pytest.raises(ConfigError, match="no option"):
        LESS(make_ctx(tmp_path, {"proj_dims": 8}))
    (two_checkpoints[0] / "optimizer.safetensors").unlink()
    with pytest.raises(InputError, match="optimizer.safetensors"):
        LESS(make_ctx(tmp_path, {"checkpoints": [str(c) for c in two_checkpoints], "proj_dim": 8}))
    with pytest.raises(InputError, match="adapter_config"):
        LESS(make_ctx(tmp_path, {"checkpoints": [str(tmp_path)], "proj_dim": 8}))
    with pytest.raises(ConfigError):
        LESS(make_ctx(tmp_path, {"checkpoints": [str(two_checkpoints[1])], "target_side": "both"}))
    # (e) checked before any warm-up or gradient: the field, the value and the choices
    with pytest.raises(ConfigError, match=r"setting 'projection': unknown projection 'sparse' "
                                          r"\(fix: use one of auto, rademacher, sjlt"):
        LESS(make_ctx(tmp_path, {"projection": "sparse"}))
    ctx = make_ctx(tmp_path, {"checkpoints": [str(two_checkpoints[1])]})
    ctx.inputs.pairs = []
    with pytest.raises(ConfigError, match="target pairs"):
        LESS(ctx)


@pytest.mark.skipif("less" not in names(), reason="the registry has no 'less'")
def test_less_through_score_pool(tmp_path, two_checkpoints):
    from prism_select.run import score_pool

    tok = tiny_tokenizer()
    d = tmp_path / "tiny"
    tiny_llama(len(tok)).save_pretrained(d)
    tok.save_pretrained(d)
    pool = tmp_path / "pool.jsonl"
    pool.write_text("".join(json.dumps({"prompt": p, "response": r}) + "\n" for p, r in POOL))
    targets = tmp_path / "targets.jsonl"
    targets.write_text("".join(json.dumps({"prompt": q, "chosen": c, "rejected": r, "task": t}) + "\n"
                               for (q, c, r), t in zip(PAIRS, TASKS)))
    opts = {"checkpoints": [str(c) for c in two_checkpoints], "proj_dim": 16, "proj_seed": 7}
    summary = score_pool(ModelSettings(str(d), device="cpu", dtype="float64"), pool, targets, tmp_path / "out",
                         ScoreSettings(method="less", progress=False, method_options=opts))
    assert summary["method"] == "less" and summary["method_info"]["name"] == "less"
    scores = torch.tensor([json.loads(x)["score"] for x in (tmp_path / "out" / "scores.jsonl").read_text().splitlines()],
                          dtype=torch.float64)
    ref, _ = reference_scores(two_checkpoints, [0.75, 0.25], 16, 7, TASKS)
    # the loaded model's RMSNorm computes in float32 (tiny.py's in-process one in float64)
    torch.testing.assert_close(scores, ref, rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------- the warm-up's size

def test_warmup_plan_keeps_less_steps_at_any_pool_size():
    opts = less_method.LessOptions()
    # LESS's own pool: 5% = 13,534 records at accumulation 128 -> 106 steps an epoch, 424 in all
    own = less_warmup.warmup_plan(270_679, opts)
    assert (own["n_examples"], own["grad_accum"], own["steps"], own["floor"]) == (13_534, 128, 424, None)
    # a pool where 5% at accumulation 1 is more than enough: the accumulation scales down
    mid = less_warmup.warmup_plan(100_000, opts)
    assert mid["grad_accum"] == round(5000 * 4 / 424) and abs(mid["steps"] - 424) < 424 * 0.05
    # 600 records: 30 are too few even at accumulation 1; the default floor grows the sample
    small = less_warmup.warmup_plan(600, opts)
    assert (small["n_examples"], small["grad_accum"], small["steps"], small["floor"]) == (106, 1, 424, "examples")
    assert small["warnings"] == []
    b1 = less_warmup.warmup_plan(600, dataclasses.replace(opts, warmup_floor="batch1"))
    assert (b1["n_examples"], b1["grad_accum"], b1["steps"], b1["floor"]) == (30, 1, 120, "batch1")
    # 40 records: the whole pool, still short of 424 steps
    tiny = less_warmup.warmup_plan(40, opts)
    assert (tiny["n_examples"], tiny["steps"]) == (40, 160)
    # an explicit accumulation is used as given, and a short run is warned of
    old = less_warmup.warmup_plan(600, dataclasses.replace(opts, grad_accum=128))
    assert (old["n_examples"], old["steps"]) == (30, 4)
    assert len(old["warnings"]) == 1 and "4 optimizer steps" in old["warnings"][0]
    with pytest.raises(ConfigError, match="warmup_floor"):
        less_warmup.warmup_plan(600, dataclasses.replace(opts, warmup_floor="more"))
    with pytest.raises(ConfigError, match="grad_accum"):
        less_warmup.warmup_plan(600, dataclasses.replace(opts, grad_accum=0))


def test_optimizer_steps_are_the_trainers(tmp_path):
    """optimizer_steps counts what ``transformers.Trainer`` runs (partial last steps included)."""
    from prism_select.finetune import FinetuneSettings, finetune

    tok = tiny_tokenizer()
    lm = LoadedModel(tiny_llama(len(tok), dtype=torch.float32), tok, ModelSettings("tiny", device="cpu"),
                     "fp", {})
    data = [encode(tok, p, r) for p, r in POOL[:7]]
    fs = FinetuneSettings(learning_rate=1e-3, epochs=2, batch_size=2, grad_accum=3, lora_r=2, lora_alpha=4,
                          target_modules=["q_proj"], progress=False)
    res = finetune(lm, data, tmp_path / "ft", fs)
    assert sum(len(x) for x in res.epoch_lrs) == less_warmup.optimizer_steps(7, 2, 3, 2) == 4


SHORT_POOL = [(f"What is {a}+{b}?", f"{a}+{b}={a + b}.") for a in range(30) for b in range(20)]


def test_warmup_on_a_600_record_pool_takes_less_steps_with_nonzero_lr(tmp_path):
    """The default warm-up of a 600-record pool: at least MIN_WARMUP_STEPS optimizer steps, none
    at lr 0 but the schedule's first warm-up step, the first checkpoint of nonzero weight, the
    steps' learning rates and losses in the method's record."""
    assert len(SHORT_POOL) == 600
    opts = {"lora_r": 2, "lora_alpha": 4, "target_modules": ["q_proj"], "proj_dim": 8}
    ctx = make_ctx(tmp_path, opts, dtype=torch.float32, records=SHORT_POOL, batch_size=64)
    LESS(ctx)
    info = ctx.info["method"]
    warm = info["warmup"]
    assert warm["steps"] >= less_warmup.MIN_WARMUP_STEPS and warm["steps"] == warm["planned_steps"] == 424
    assert warm["effective_batch"] == 1 and warm["n_examples"] == 106 and warm["floor"] == "examples"
    lrs = [lr for e in warm["epoch_lrs"] for lr in e]
    scheduled_warmup = -(-0.03 * len(lrs) // 1)  # transformers: ceil(warmup_ratio x steps)
    assert warm["zero_lr_steps"] == sum(lr == 0 for lr in lrs) <= scheduled_warmup
    assert all(lr > 0 for lr in lrs[1:]) and len(warm["epoch_lrs"]) == 4
    assert info["checkpoint_weights"][0] > 0 and info["skipped_checkpoints"] == []
    assert len(warm["losses"]) == len(lrs) and all(x["loss"] > 0 for x in warm["losses"])
    assert info["warnings"] == []


def test_short_warmup_is_warned_of(tmp_path, caplog):
    opts = {"lora_r": 2, "lora_alpha": 4, "target_modules": ["q_proj"], "proj_dim": 8, "grad_accum": 128,
            "epochs": 1}
    ctx = make_ctx(tmp_path, opts, dtype=torch.float32)
    with caplog.at_level("WARNING"):
        LESS(ctx)
    assert ctx.info["method"]["warmup"]["steps"] == 1
    assert ctx.info["method"]["warnings"] and "1 optimizer steps" in ctx.info["method"]["warnings"][0]
    assert any("fewer than 50" in r.getMessage() for r in caplog.records)


def test_cache_counts_a_finished_less_warmup_complete(tmp_path):
    from prism_select import cache

    opts = {"lora_r": 2, "lora_alpha": 4, "target_modules": ["q_proj"], "proj_dim": 8, "epochs": 1,
            "warmup_steps": 2}
    ctx = make_ctx(tmp_path, opts, dtype=torch.float32)
    LESS(ctx)
    [entry] = [e for e in cache.entries(tmp_path / "cache") if e.kind == "less"]
    assert entry.complete and Path(ctx.info["method"]["warmup"]["path"]) == entry.path
    assert cache.prune(tmp_path / "cache", incomplete_age_s=0) == []
