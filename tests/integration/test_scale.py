"""Running at scale: the memory plan, the grouped curvature fit, the target direction
accumulated in host memory, the transient (precondition-as-you-fit) route, and the cache.

Every route is checked against the ungrouped, on-device computation in float64 on a
tiny Llama (the float64 references of test_numerics.py check that one)."""

import errno
import json
import logging
import os
import time

import pytest
import torch

from prism_select.curvature import factors as factors_mod, spill as spill_mod
from prism_select import cache
from prism_select.curvature import CurvatureSettings, FitLayout, fit_curvature
from prism_select.runtime.execution import ExecutionContext
from prism_select.plan import GiB, ExampleSize, PlanError, Shards, make_groups, make_plan, parse_bytes, units
from prism_select.preference import compute_preference

from reference import rel_err

GROUP_TOL = 1e-10  # float64: a grouped fit sums the same statistics in the same order
HOST_TOL = 1e-12  # float64: host and device accumulation differ only in summation order
#: float64: the split-half run and the heuristic run at its factor damp the same fit alike
SPLIT_HALF_RTOL = 1e-10
SPLIT_HALF_AGREEMENT_ATOL = 1e-9  # float64: stacked and one-by-one scoring differ only in summation order


def _three_groups(modules):
    names = list(modules)
    return [names[:3], names[3:9], names[9:]]


@pytest.mark.parametrize("kind", ["ekfac", "kfac", "diagonal"])
@pytest.mark.parametrize("store", ["device", "host"])
def test_grouped_fit_equals_one_group(model, modules, tok, encoded_pool, kind, store):
    s = CurvatureSettings(kind=kind, batch_size=3)
    one = fit_curvature(model, modules, encoded_pool, s, pad_id=tok.pad_token_id)
    grouped = fit_curvature(model, modules, encoded_pool, s, pad_id=tok.pad_token_id,
                            layout=FitLayout(_three_groups(modules), store))
    assert set(grouped.tensors) == set(one.tensors)
    for k, t in one.tensors.items():
        if k.endswith("::QA") or k.endswith("::QS"):  # eigenvectors up to sign: compare projectors
            g = grouped.tensors[k]
            assert rel_err(g @ g.T, t @ t.T) <= GROUP_TOL, k
        else:
            assert rel_err(grouped.tensors[k], t) <= GROUP_TOL, k
        assert grouped.tensors[k].device.type == "cpu"
    assert grouped.damping == pytest.approx(one.damping, rel=GROUP_TOL)
    g = {n: torch.randn(*one.eigenvalues(n).shape, dtype=torch.float64) for n in modules}
    a, b = one.precondition(g), grouped.precondition(g)
    for n in modules:
        assert rel_err(b[n], a[n]) <= GROUP_TOL


@pytest.mark.parametrize("offload", [None, False])  # False: the eigenbases stay on the device (plan)
def test_transient_fit_preconditions_group_by_group(model, modules, tok, encoded_pool, offload):
    s = CurvatureSettings(kind="ekfac", batch_size=4)
    one = fit_curvature(model, modules, encoded_pool, s, pad_id=tok.pad_token_id)
    g = {n: torch.randn(*one.eigenvalues(n).shape, dtype=torch.float64) for n in modules}
    seen, v = [], {}

    def on_group(layers, part):
        seen.append(list(layers))
        v.update(part.precondition({n: g[n] for n in layers}))

    cur = fit_curvature(model, modules, encoded_pool, s, pad_id=tok.pad_token_id,
                        layout=FitLayout(_three_groups(modules), "transient", offload=offload), on_group=on_group)
    assert seen == _three_groups(modules)
    assert cur.tensors == {} and set(cur.damping) == set(modules)
    ref = one.precondition(g)
    for n in modules:
        assert rel_err(v[n], ref[n]) <= GROUP_TOL
    with pytest.raises(Exception, match="not kept"):
        cur.precondition(g)


def test_fit_groups_must_cover_the_layers(model, modules, tok, encoded_pool):
    names = list(modules)
    with pytest.raises(ValueError, match="cover"):
        fit_curvature(model, modules, encoded_pool, CurvatureSettings(), pad_id=tok.pad_token_id,
                      layout=FitLayout([names[:2]]))


@pytest.mark.parametrize("method", ["prism", "equal", "unpaired"])
@pytest.mark.parametrize("one_graph", [False, True])
def test_direction_accumulated_in_host_memory(model, modules, tok, encoded_pairs, method, one_graph):
    chosen, rejected = encoded_pairs
    dev = compute_preference(model, modules, chosen, rejected, pad_id=tok.pad_token_id, batch_size=2,
                             method=method)
    host = compute_preference(model, modules, chosen, rejected, pad_id=tok.pad_token_id, batch_size=2,
                              method=method, accumulate="host", store="host", one_graph=one_graph)
    for n in modules:
        assert host.direction[n].device.type == "cpu"
        assert rel_err(host.direction[n], dev.direction[n]) <= HOST_TOL
    assert torch.equal(host.pi, dev.pi)
    assert all(p.grad is None for p in model.parameters())


def test_direction_with_bias_in_host_memory(tok, encoded_pairs):
    from tiny import tiny_llama
    m = tiny_llama(len(tok))
    m.config.attention_bias = True
    for layer in m.model.layers:  # give the attention projections a bias
        for name in ("q_proj", "k_proj", "v_proj"):
            lin = getattr(layer.self_attn, name)
            lin.bias = torch.nn.Parameter(torch.randn(lin.out_features, dtype=torch.float64))
    mods = {n: x for n, x in m.named_modules() if isinstance(x, torch.nn.Linear) and ".layers." in n}
    chosen, rejected = encoded_pairs
    a = compute_preference(m, mods, chosen, rejected, pad_id=tok.pad_token_id, batch_size=2)
    b = compute_preference(m, mods, chosen, rejected, pad_id=tok.pad_token_id, batch_size=2, accumulate="host")
    for n in mods:
        assert b.direction[n].shape == a.direction[n].shape
        assert rel_err(b.direction[n], a.direction[n]) <= HOST_TOL


# ----------------------------------------------------------------------------- plan

def test_units_keep_decoder_blocks_together():
    names = ["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.up_proj",
             "model.layers.1.self_attn.q_proj", "model.layers.1.mlp.down_proj", "lm_head"]
    assert units(names) == [names[:2], names[2:4], names[4:]]
    cost = {n: 1 for n in names}
    assert make_groups(names, cost, 4) == [names[:4], names[4:]]
    assert make_groups(names, cost, 2) == [names[:2], names[2:4], names[4:]]
    assert make_groups(names, cost, 1) == [[n] for n in names]  # blocks split when one does not fit
    assert make_groups(names, {**cost, "lm_head": 5}, 4) is None


def test_parse_bytes():
    assert parse_bytes("70GiB") == 70 * GiB
    assert parse_bytes("1.5g") == int(1.5 * GiB)
    assert parse_bytes("80GB") == 80 * 10 ** 9
    assert parse_bytes(2) == 2 * GiB
    assert parse_bytes(None) is None
    with pytest.raises(Exception, match="max_gpu_memory"):
        parse_bytes("lots")


def _plan(model, modules, total_gib, weights_gib=0.0, example=1 << 20, host_gib=1000, **kw):
    return make_plan(model, modules, kind=kw.pop("kind", "ekfac"), device="cuda", batch_size=8,
                     fit_batch_size=8, example=ExampleSize(example, 64, 100),
                     gpu_total=int(total_gib * GiB), weights=int(weights_gib * GiB),
                     host_available=int(host_gib * GiB), **kw)


def test_plan_groups_the_fit_only_when_needed(model, modules):
    roomy = _plan(model, modules, 100)
    assert roomy.fit_groups == [list(modules)] and roomy.curvature_store == "device"
    assert roomy.direction["accumulate"] == "device" and roomy.scoring["batch_size"] == 8
    # a device whose usable memory holds about 60% of the (tiny) factors next to 8 examples
    from prism_select.runtime.layers import layer_shape
    from prism_select.plan import (ACTIVATION_SAFETY, EIGH_BUFFERS, HEADROOM_BYTES, RECENT_INPUTS, pass1_bytes,
                                   pass2_bytes)
    shapes = [layer_shape(m) for m in modules.values()]
    factors = sum(max(pass1_bytes(o, i, 8), pass2_bytes(o, i, 8, 8)) for o, i in shapes)
    max_in = max(i for _, i in shapes)
    work = max(EIGH_BUFFERS * 8 * max(max(s) for s in shapes) ** 2, 8 * max(o * i for o, i in shapes) * 16,
               8 * (RECENT_INPUTS * max_in ** 2 + 8 * max_in))
    usable = int(HEADROOM_BYTES + 8 * (1 << 10) * ACTIVATION_SAFETY + work + 0.6 * factors)
    tight = make_plan(model, modules, kind="ekfac", device="cuda", batch_size=8, fit_batch_size=8,
                      example=ExampleSize(1 << 10, 1, 1), gpu_total=usable, weights=0,
                      host_available=1 << 40)
    assert len(tight.fit_groups) == 2 and sum(tight.fit_groups, []) == list(modules)
    assert tight.curvature_store == "host"
    # a host that holds a group's eigenbases while it is fitted, not the whole curvature
    small_host = make_plan(model, modules, kind="ekfac", device="cuda", batch_size=8, fit_batch_size=8,
                           example=ExampleSize(1 << 10, 1, 1), gpu_total=usable, weights=0,
                           host_available=int(1.5 * tight.fit["stored_bytes"]))
    assert small_host.curvature_store == "transient" and small_host.fit["offload"]
    assert sum(small_host.fit_groups, []) == list(modules) and len(small_host.fit_groups) >= 2
    assert any("precondition" in n for n in small_host.notes)
    assert small_host.host["peak"] <= small_host.host["usable"]
    assert "host memory" in small_host.describe()
    json.dumps(small_host.to_json())  # recorded in run.json
    # a host that holds v but no group's float32 eigenbases: they stay on the device
    largest = 8 * max(o * i for o, i in shapes)
    host = small_host.host["direction"] + small_host.host["scoring"] + 2 * largest
    keep = make_plan(model, modules, kind="ekfac", device="cuda", batch_size=8, fit_batch_size=8,
                     example=ExampleSize(1 << 10, 1, 1), gpu_total=usable, weights=0,
                     host_available=int(host / 0.9))
    assert keep.curvature_store == "transient" and keep.fit["offload"] is False
    assert len(keep.fit_groups) > len(small_host.fit_groups) and any("stay on the device" in n for n in keep.notes)
    with pytest.raises(PlanError, match="does not fit host memory"):
        make_plan(model, modules, kind="ekfac", device="cuda", batch_size=8, fit_batch_size=8,
                  example=ExampleSize(1 << 10, 1, 1), gpu_total=usable, weights=0, host_available=1)


def test_sharded_factors_need_fewer_fit_groups(model, modules):
    """Under FSDP each rank holds about 1/K of a fit group's K-FAC / EK-FAC factors, so the
    same device fits the fit in fewer groups; a diagonal fit (not sharded) plans as before."""
    from prism_select.plan import HEADROOM_BYTES
    kw = dict(device="cuda", batch_size=8, fit_batch_size=8, example=ExampleSize(1 << 10, 1, 1),
              weights=0, host_available=1 << 40)

    def groups(total, shards=1):
        try:
            return len(make_plan(model, modules, kind="ekfac", gpu_total=total, shards=Shards(shards),
                                 **kw).fit_groups)
        except PlanError:
            return 0

    # the most memory with which one rank still needs two groups or more (a sharded rank
    # also holds one layer's eigenbases from its owner, large next to this tiny model's
    # factors: with less memory that fixed cost outweighs the shards)
    total = max(t for t in range(HEADROOM_BYTES, HEADROOM_BYTES + (8 << 20), 4096) if groups(t) >= 2)
    one = make_plan(model, modules, kind="ekfac", gpu_total=total, **kw)
    four = make_plan(model, modules, kind="ekfac", gpu_total=total, shards=Shards(4), **kw)
    assert four.fit["factor_shards"] == 4 and one.fit["factor_shards"] == 1
    assert sum(four.fit_groups, []) == list(modules)
    assert len(four.fit_groups) < len(one.fit_groups)
    assert four.fit["peak"] <= four.usable
    assert "over 4 ranks" in four.describe()
    diag_one = make_plan(model, modules, kind="diagonal", gpu_total=total, **kw)
    diag_four = make_plan(model, modules, kind="diagonal", gpu_total=total, shards=Shards(4), **kw)
    assert diag_four.fit_groups == diag_one.fit_groups and diag_four.fit["factor_shards"] == 1


def test_sharded_sums_once_per_pass_only_where_a_group_fits_every_rank(model, modules):
    """--fsdp-sums: auto sends the fit's statistics to their owners once per pass where a
    whole group's sums fit every rank beside its share of the curvature (the plan's peak
    then counts them), and every step where only the shares fit; pass where it cannot fit
    is refused before any work, naming the fix."""
    from prism_select.plan import HEADROOM_BYTES
    kw = dict(kind="ekfac", device="cuda", batch_size=8, fit_batch_size=8, example=ExampleSize(1 << 10, 1, 1),
              weights=0, host_available=1 << 40, shards=Shards(4))
    roomy = make_plan(model, modules, gpu_total=80 * GiB, **kw)
    assert roomy.fit["sums"] == "pass" and "once per pass" in roomy.describe()
    step = make_plan(model, modules, gpu_total=80 * GiB, **{**kw, "shards": Shards(4, sums="step")})
    assert step.fit["sums"] == "step" and "every step" in step.describe()
    assert step.fit["peak"] < roomy.fit["peak"] <= roomy.usable  # a whole group's sums counted
    # the least memory with which the sharded plan holds the fit in one group: there a
    # whole group's sums per rank do not fit
    total = min(t for t in range(HEADROOM_BYTES, HEADROOM_BYTES + (8 << 20), 4096)
                if _fits_one_group(model, modules, t, kw))
    tight = make_plan(model, modules, gpu_total=total, **kw)
    assert tight.fit["sums"] == "step" and tight.fit["peak"] <= tight.usable
    with pytest.raises(PlanError, match="--fsdp-sums step"):
        make_plan(model, modules, gpu_total=total, **{**kw, "shards": Shards(4, sums="pass")})
    # one rank (no sharding) has nothing to send
    assert make_plan(model, modules, gpu_total=80 * GiB, **{**kw, "shards": Shards(1)}).fit["sums"] == "step"


def test_blocks_keep_gathered_weights_only_where_the_whole_model_fits(model, modules):
    """--fsdp-keep-gathered: auto keeps each block's gathered weights from forward to
    backward where every stage's peak leaves room for the rest of the model (counted in the
    plan's peak), not where it does not; on where it cannot fit is refused naming the fix."""
    from prism_select.plan import HEADROOM_BYTES
    full = 64 << 20  # a model far larger than its shard (weights=0 below: the allocations)
    kw = dict(kind="ekfac", device="cuda", batch_size=8, fit_batch_size=8, example=ExampleSize(1 << 10, 1, 1),
              weights=0, host_available=1 << 40, shards=Shards(4, full_weights=full))
    roomy = make_plan(model, modules, gpu_total=80 * GiB, **kw)
    off = make_plan(model, modules, gpu_total=80 * GiB,
                    **{**kw, "shards": Shards(4, keep_gathered="off", full_weights=full)})
    assert roomy.keep_gathered and not off.keep_gathered
    assert roomy.peak == off.peak + full * 3 // 4 and any("keeps its gathered" in n for n in roomy.notes)
    assert roomy.to_json()["keep_gathered"] is True
    # room for every stage but not for the rest of the model as well
    tight_total = off.peak + full // 2 + HEADROOM_BYTES
    tight = make_plan(model, modules, gpu_total=tight_total, **kw)
    assert not tight.keep_gathered and tight.peak <= tight.usable
    with pytest.raises(PlanError, match="--fsdp-keep-gathered off"):
        make_plan(model, modules, gpu_total=tight_total,
                  **{**kw, "shards": Shards(4, keep_gathered="on", full_weights=full)})
    assert not make_plan(model, modules, gpu_total=80 * GiB,
                         **{**kw, "shards": Shards(1, full_weights=full)}).keep_gathered


def _fits_one_group(model, modules, total, kw) -> bool:
    try:
        return len(make_plan(model, modules, gpu_total=total,
                             **{**kw, "shards": Shards(kw["shards"].count, sums="step")}).fit_groups) == 1
    except PlanError:
        return False


def test_ranks_of_one_host_share_its_memory(model, modules, monkeypatch):
    """torchrun's ranks on one host plan at the same time against the same memory: each
    plans with its share of what is available."""
    import prism_select.runtime.memory as memory
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 100 * GiB)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert memory.host_share_bytes() == 25 * GiB
    kw = dict(kind="ekfac", device="cuda", batch_size=8, fit_batch_size=8, example=ExampleSize(1 << 10, 1, 1),
              gpu_total=80 * GiB, weights=0)
    assert make_plan(model, modules, **kw).host["available"] == 25 * GiB
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert make_plan(model, modules, **kw).host["available"] == 100 * GiB


def test_plan_lowers_batch_sizes_then_fails_with_what_would_fit(model, modules):
    from prism_select.plan import HEADROOM_BYTES
    example = 1 << 26  # 64 MiB of activations per example: 8 of them do not fit below
    plan = make_plan(model, modules, kind="ekfac", device="cuda", batch_size=8, fit_batch_size=8,
                     example=ExampleSize(example, 64, 100),
                     gpu_total=HEADROOM_BYTES + int(3.5 * example * 1.25), weights=0, host_available=1 << 40)
    assert plan.scoring["batch_size"] == 2 and plan.fit["batch_size"] <= 2
    assert any("batches of 2" in n for n in plan.notes)
    with pytest.raises(PlanError, match="what would fit: a PEFT adapter"):
        _plan(model, modules, 1, weights_gib=5)
    with pytest.raises(PlanError, match=r"does not fit on cuda.*--modules REGEX \.\.\.; now 14"):
        make_plan(model, modules, kind="ekfac", device="cuda", batch_size=8, fit_batch_size=8,
                  example=ExampleSize(1 << 10, 1, 1), gpu_total=HEADROOM_BYTES + 30_000,
                  weights=0, host_available=1 << 40)


def test_cpu_plan_is_unbounded(model, modules):
    plan = make_plan(model, modules, kind="ekfac", device="cpu", batch_size=8, fit_batch_size=8,
                     example=ExampleSize(0, 64, 100))
    assert not plan.bounded and plan.curvature_store == "device" and plan.fit_groups == [list(modules)]
    assert "memory plan on cpu" in plan.describe()


# ----------------------------------------------------------------------------- cache

def _entry(root, kind, name, size, age):
    d = cache.claim(root / kind / name)
    (d / "data.bin").write_bytes(b"x" * size)
    marker = d / cache.MARKERS[kind]
    marker.write_text("{}")
    t = time.time() - age
    os.utime(marker, (t, t))
    return d


def test_cache_lists_and_prunes_least_recently_used(tmp_path):
    old = _entry(tmp_path, "curvature", "a", 1000, age=300)
    mid = _entry(tmp_path, "models", "b", 1000, age=200)
    new = _entry(tmp_path, "curvature", "c", 1000, age=100)
    broken = cache.claim(tmp_path / "less" / "d")  # a writer killed before its content marker
    (broken / "x").write_bytes(b"y" * 10)
    os.utime(broken, (time.time() - 7200, time.time() - 7200))
    es = cache.entries(tmp_path)
    assert [e.path for e in es] == [broken, old, mid, new]
    assert [e.complete for e in es] == [False, True, True, True]
    cache.touch(old)  # reading an entry makes it the most recently used
    gone = cache.prune(tmp_path, max_bytes=sum(e.size for e in es if e.path in (old, new)) + 50)
    assert {e.path for e in gone} == {broken, mid}
    assert old.exists() and new.exists()
    assert cache.clear(tmp_path, "curvature") and cache.entries(tmp_path) == []


def test_make_room_refuses_an_entry_larger_than_the_bound(tmp_path):
    _entry(tmp_path, "curvature", "a", 1000, age=10)
    assert not cache.make_room(tmp_path, 5000, max_bytes=4000)
    assert cache.make_room(tmp_path, 3500, max_bytes=4000)
    assert cache.entries(tmp_path) == []  # evicted to make room


def test_make_room_warns_when_it_evicts_entries_used_recently(tmp_path, caplog):
    """Evicting an entry used within RECENT_USE_S means the runs sharing the cache will
    compute it again: the warning names the bound and the fix; evicting old entries is
    silent."""
    _entry(tmp_path, "curvature", "old", 1000, age=cache.RECENT_USE_S + 600)
    with caplog.at_level("WARNING", logger="prism_select.cache"):
        assert cache.make_room(tmp_path, 1500, max_bytes=2000)
    assert caplog.records == []
    _entry(tmp_path, "curvature", "a", 1000, age=120)
    _entry(tmp_path, "curvature", "b", 1000, age=60)
    with caplog.at_level("WARNING", logger="prism_select.cache"):
        assert cache.make_room(tmp_path, 1500, max_bytes=2600)
    [rec] = caplog.records
    assert "evicted 1 entry used in the last 60 minutes" in rec.getMessage()
    assert "--cache-max-gb" in rec.getMessage() and "--cache-dir" in rec.getMessage()
    assert [e.path.name for e in cache.entries(tmp_path)] == ["b"]


def test_failed_cache_write_warns_and_keeps_the_run_going(tmp_path, caplog):
    d = tmp_path / "curvature" / "k"

    def write():
        d.mkdir(parents=True, exist_ok=True)
        (d / "factors.safetensors.tmp").write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    assert cache.guarded_write(d, write, "the fitted curvature") is False
    assert not d.exists()
    assert "could not save the fitted curvature" in caplog.text

    def bug():
        raise KeyError("a programming error is not swallowed")

    with pytest.raises(KeyError):
        cache.guarded_write(d, bug, "x")


def test_saving_a_curvature_copies_no_host_tensor_but_shared_ones(tmp_path, monkeypatch):
    """Saving writes the host tensors themselves (a copy of every factor doubled the host
    memory of a fit: 1.6 GB more for the embedded model); a tensor sharing storage with
    another is copied, since safetensors refuses shared storage; the file loads equal."""
    from prism_select.curvature import base
    from prism_select.curvature.base import Curvature
    Q = torch.randn(4, 4, dtype=torch.float64)
    t = {"a::QA": Q, "b::QA": Q, "a::QS": torch.randn(3, 3, dtype=torch.float64),
         "a::Lambda": torch.rand(3, 4, dtype=torch.float64), "b::QS": torch.randn(6, 3, dtype=torch.float64)[::2],
         "b::Lambda": torch.rand(3, 4, dtype=torch.float64)}
    cur = Curvature("ekfac", ["a", "b"], t, {"a": 0.1, "b": 0.2})
    written, real = {}, base.save_file
    monkeypatch.setattr(base, "save_file", lambda d, f: (written.update(d), real(d, f)))
    cur.save(tmp_path, {"k": 1})
    for k in ("a::QA", "a::QS", "a::Lambda", "b::Lambda"):
        assert written[k].data_ptr() == t[k].data_ptr(), k
    assert written["b::QA"].data_ptr() != Q.data_ptr()
    back = Curvature.load(tmp_path, expect={"k": 1})
    assert all(torch.equal(back.tensors[k], t[k]) for k in t)


# ----------------------------------------------------------------------------- score_pool

@pytest.fixture
def run_files(tmp_path, tok):
    from conftest import PAIRS, POOL
    from tiny import tiny_llama
    m = tiny_llama(len(tok), dtype=torch.float64)
    m.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    with open(tmp_path / "pool.jsonl", "w") as f:
        for i in range(24):
            p, r = POOL[i % len(POOL)]
            f.write(json.dumps({"id": i, "prompt": p + " #" * (i % 5), "response": r}) + "\n")
    with open(tmp_path / "targets.jsonl", "w") as f:
        for q, c, r in PAIRS:
            f.write(json.dumps({"prompt": q, "chosen": c, "rejected": r}) + "\n")
    return tmp_path


def _score(d, out, **kw):
    from prism_select.curvature import CurvatureSettings
    from prism_select.model import ModelSettings
    from prism_select.run import score_pool
    from prism_select.settings import ScoreSettings
    ms = ModelSettings(model=str(d / "model"), dtype="float64", device="cpu", cache_dir=str(d / "cache"))
    kw.setdefault("damping_rule", "heuristic")  # the routes compare under one rule; auto is tested on its own
    cs = CurvatureSettings(**{k: kw.pop(k) for k in list(kw)
                              if k in ("damping", "damping_noise", "damping_factor", "damping_rule", "kind")})
    summary = score_pool(ms, d / "pool.jsonl", d / "targets.jsonl", d / out,
                         ScoreSettings(progress=False, batch_size=4, chunk_size=8, **kw), cs)
    scores = [json.loads(line)["score"] for line in (d / out / "scores.jsonl").read_text().splitlines()]
    return summary, torch.tensor(scores, dtype=torch.float64)


def _forced_plan(monkeypatch, store):
    """A plan as a small device would make it: the fit in three groups, the curvature kept on
    the host or not at all, the direction accumulated and kept in host memory."""
    from prism_select.run import preflight

    real = preflight.make_plan

    def fake(model, modules, **kw):
        plan = real(model, modules, **kw)
        plan.fit["groups"] = _three_groups(modules)
        plan.curvature_store = store
        plan.direction.update(accumulate="host", store="host")
        return plan

    monkeypatch.setattr(preflight, "make_plan", fake)


@pytest.mark.parametrize("store", ["host", "transient"])
def test_score_pool_under_a_grouped_plan_matches_the_default(run_files, monkeypatch, store):
    ref_summary, ref = _score(run_files, "ref")
    assert ref_summary["memory_plan"]["curvature_store"] == "device"
    _forced_plan(monkeypatch, store)
    summary, got = _score(run_files, f"run-{store}")
    assert rel_err(got, ref) <= GROUP_TOL
    assert summary["curvature"]["store"] == store and summary["curvature"]["groups"] == 3
    assert (summary["curvature"]["path"] is None) == (store == "transient")  # a transient fit is not cached


def test_transient_run_resumes_finished_groups(run_files, monkeypatch):
    from prism_select.curvature import fit as fitmod
    _, ref = _score(run_files, "ref")
    _forced_plan(monkeypatch, "transient")
    real = fitmod._fit_group
    calls = []

    def dying(*a, **kw):  # the process dies while fitting the third group
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(fitmod, "_fit_group", dying)
    with pytest.raises(KeyboardInterrupt):
        _score(run_files, "run")
    parts = sorted(p.name for p in (run_files / "run" / ".partial").glob("scores_v_group*"))
    assert parts == ["scores_v_group0000.json", "scores_v_group0000.safetensors",
                     "scores_v_group0001.json", "scores_v_group0001.safetensors", "scores_v_groups.json"]
    calls.clear()
    monkeypatch.setattr(fitmod, "_fit_group", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    from prism_select.run import preflight
    planned = preflight.make_plan

    def regrouped(model, modules, **kw):  # the resumed process would group differently
        plan = planned(model, modules, **kw)
        names = list(modules)
        plan.fit["groups"] = [names[:7], names[7:]]
        return plan

    monkeypatch.setattr(preflight, "make_plan", regrouped)
    summary, got = _score(run_files, "run")
    assert len(calls) == 1  # only the unfinished group is fitted again
    assert summary["curvature"]["resumed_groups"] == 2
    assert rel_err(got, ref) <= GROUP_TOL


def test_transient_run_keeps_v_once_on_disk_and_resumes_after_the_fit(run_files, monkeypatch):
    """The Qwen3-14B run on one GPU fitted all five groups, then ran out of disk writing a
    merged copy of v (26 GiB) beside its group files (26 GiB). The group files are v's one
    saved copy; a run stopped after the fit (here: in scoring) refits nothing and gives
    the same scores and the same curvature record."""
    from prism_select.curvature import fit as fitmod
    from prism_select.run import scorer
    _, ref = _score(run_files, "ref")
    _forced_plan(monkeypatch, "transient")
    real_score = scorer.score_encoded

    def dying(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(scorer, "score_encoded", dying)
    with pytest.raises(KeyboardInterrupt):
        _score(run_files, "run")
    partial = run_files / "run" / ".partial"
    assert not (partial / "scores_v.safetensors").exists()
    assert len(list(partial.glob("scores_v_group*.safetensors"))) == 3
    monkeypatch.setattr(scorer, "score_encoded", real_score)
    real_fit, fitted = fitmod._fit_group, []
    monkeypatch.setattr(fitmod, "_fit_group", lambda *a, **kw: (fitted.append(1), real_fit(*a, **kw))[1])
    summary, got = _score(run_files, "run")
    assert fitted == []
    assert rel_err(got, ref) <= GROUP_TOL
    assert summary["curvature"]["store"] == "transient" and summary["curvature"]["groups"] == 3
    assert summary["curvature"]["resumed"] and summary["curvature"]["resumed_groups"] == 3


def test_transient_run_without_disk_for_v_fails_before_the_fit(run_files, monkeypatch):
    from collections import namedtuple

    from prism_select.curvature import fit as fitmod
    from prism_select.errors import OutOfResourceError
    from prism_select.run import preflight
    _forced_plan(monkeypatch, "transient")
    fitted = []
    monkeypatch.setattr(fitmod, "_fit_group", lambda *a, **kw: fitted.append(1))
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda p: usage(1 << 40, 1 << 40, 1 << 20))
    with pytest.raises(OutOfResourceError, match="preconditioned direction") as e:
        _score(run_files, "run")
    assert e.value.resource == "disk" and fitted == []


def test_resumed_transient_run_fits_its_own_plan_where_no_group_finished(run_files, monkeypatch):
    """The 14B failure under --max-gpu-memory 79.6GiB: the run resumed one whose first
    (uncapped) process, planned in 2 groups, had been killed before any group finished,
    and fitted the saved 2-group layout instead of its own 5 groups (out of GPU memory in
    the first group). A resumed run keeps only the finished groups of the saved layout."""
    from prism_select.curvature import fit as fitmod
    from prism_select.run import job, preflight
    _, ref = _score(run_files, "ref")
    real_plan, real_fit = preflight.make_plan, fitmod._fit_group
    names = []

    def one_group(model, modules, **kw):  # the first process: a larger device, one group
        plan = real_plan(model, modules, **kw)
        names[:] = list(modules)
        plan.fit["groups"], plan.curvature_store = [list(modules)], "transient"
        return plan

    def dying(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(preflight, "make_plan", one_group)
    monkeypatch.setattr(fitmod, "_fit_group", dying)
    monkeypatch.setattr(job, "drop_partial_without_chunks", lambda d: None)  # killed: nothing cleaned
    with pytest.raises(KeyboardInterrupt):
        _score(run_files, "run")
    assert json.loads((run_files / "run" / ".partial" / "scores_v_groups.json").read_text()) == [names]
    _forced_plan(monkeypatch, "transient")  # the resumed process plans three groups
    fitted = []
    monkeypatch.setattr(fitmod, "_fit_group", lambda m, sub, *a, **kw: (fitted.append(list(sub)),
                                                                         real_fit(m, sub, *a, **kw))[1])
    summary, got = _score(run_files, "run")
    assert fitted == _three_groups(dict.fromkeys(names))
    assert rel_err(got, ref) <= GROUP_TOL


def test_resume_groups_keeps_finished_groups_and_regroups_the_rest():
    from prism_select.run.folder import resume_groups
    saved = [["a", "b", "c"], ["d", "e", "f"], ["g", "h"]]
    planned = [["a", "b"], ["c", "d"], ["e"], ["f", "g"], ["h"]]
    got = resume_groups(saved, planned, lambda k: k == 1)  # only the second group finished
    assert got == [["a", "b"], ["d", "e", "f"], ["c"], ["g"], ["h"]]
    assert resume_groups(got, planned, lambda k: k == 1) == got  # idempotent
    assert resume_groups(saved, [["a"], ["b", "c", "d", "e", "f", "g", "h"]], lambda k: k == 1) == \
        [["a"], ["d", "e", "f"], ["b", "c", "g", "h"]]
    assert resume_groups(saved, [saved[0] + saved[1] + saved[2]], lambda k: False) == [saved[0] + saved[1] + saved[2],
                                                                                       [], []]


def test_new_damping_reuses_the_fit(run_files):
    s1, a = _score(run_files, "d1")
    s2, b = _score(run_files, "d2", damping=1e-3)
    assert not s1["curvature"]["reused"] and s2["curvature"]["reused"]
    assert s1["curvature"]["path"] == s2["curvature"]["path"]
    assert s2["curvature"]["damping"]["max"] == pytest.approx(1e-3)
    assert rel_err(a, b) > 1e-6  # the damping was applied, not the cached one


def test_split_half_damping_rule(run_files):
    """--damping-rule split-half records the halves' agreement at every factor of the
    ladder, follows the rule on it, and scores as the heuristic damping at the chosen
    factor does (identity when none agrees), reusing the run's one fit."""
    from prism_select.curvature.support import DAMPING_LADDER, supported_damping_factor
    s1, a = _score(run_files, "sh", damping_rule="split-half")
    check = s1["curvature"]["split_half"]
    walked = sorted(map(float, check["agreement"]), reverse=True)
    assert check["n_fit"] == 24 and walked == sorted(DAMPING_LADDER, reverse=True)[:len(walked)]
    factor = check["damping_factor"]
    assert factor == supported_damping_factor({float(f): x for f, x in check["agreement"].items()})
    assert "note" not in s1["curvature"]
    _, ref = _score(run_files, "ref", kind="identity") if factor is None else _score(run_files, "ref",
                                                                                      damping_factor=factor)
    assert rel_err(a, ref) <= SPLIT_HALF_RTOL


def test_split_half_scores_a_bounded_sample_and_reuses_the_half_fits(run_files, monkeypatch):
    """The halves are compared on at most AGREEMENT_EXAMPLES fit examples, and their fits
    come from the curvature cache in a later run on the same pool."""
    from prism_select.curvature import store, support
    from prism_select.run import scorer, split_half
    monkeypatch.setattr(support, "AGREEMENT_EXAMPLES", 10)
    scored, stacked, fitted = [], [], []
    real_score, real_many, real_fit = scorer.score_encoded, split_half.score_directions, store.fit_curvature
    for module in (scorer, split_half):  # the pool's scoring and the check's sample
        monkeypatch.setattr(module, "score_encoded", lambda m, mods, enc, *a, **kw: (
            scored.append(len(enc)), real_score(m, mods, enc, *a, **kw))[1])
    monkeypatch.setattr(split_half, "score_directions", lambda m, mods, enc, vs, **kw: (
        stacked.append((len(enc), len(vs))), real_many(m, mods, enc, vs, **kw))[1])
    monkeypatch.setattr(store, "fit_curvature", lambda m, mods, enc, *a, **kw: (fitted.append(len(enc)),
                                                                                 real_fit(m, mods, enc, *a, **kw))[1])
    s1, a = _score(run_files, "sh", damping_rule="split-half")
    assert sorted(fitted) == [12, 12, 24]  # the run's fit and its two halves
    # the halves' directions at every rung scored together on 10 examples; the pool's own scores (24) beside
    assert stacked == [(10, 2 * len(support.DAMPING_LADDER))] and scored == [24]
    fitted.clear()
    s2, b = _score(run_files, "sh2", damping_rule="split-half")
    assert fitted == [] and s2["curvature"]["split_half"] == s1["curvature"]["split_half"] and torch.equal(a, b)
    # directions too large to stack: each rung scored on its own as the walk reaches it, with the same result
    monkeypatch.setattr(support, "STACKED_LADDER_MAX_ELEMENTS", 0)
    scored.clear()
    stacked.clear()
    s3, c = _score(run_files, "sh3", damping_rule="split-half")
    walked = s3["curvature"]["split_half"]
    assert stacked == [] and scored.count(10) == 2 * len(walked["agreement"])
    assert walked["damping_factor"] == s1["curvature"]["split_half"]["damping_factor"]
    for f, x in walked["agreement"].items():
        assert x == pytest.approx(s1["curvature"]["split_half"]["agreement"][f], abs=SPLIT_HALF_AGREEMENT_ATOL)
    assert torch.equal(a, c)
    # k rungs a pass (what a bounded plan has room for): the walk's rungs in chunks of k, the same check
    monkeypatch.setattr(support, "STACKED_LADDER_MAX_ELEMENTS", 1 << 30)
    for k in (1, 3):
        monkeypatch.setattr(split_half.SplitHalfCheck, "_ladder_rungs", lambda self, direction, k=k: k)
        scored.clear()
        stacked.clear()
        s4, d = _score(run_files, f"sh-k{k}", damping_rule="split-half")
        chunked = s4["curvature"]["split_half"]
        n = len(chunked["agreement"])
        assert stacked == [(10, 2 * min(k, len(support.DAMPING_LADDER) - i)) for i in range(0, n, k)]
        assert scored == [24] and chunked == s1["curvature"]["split_half"] and torch.equal(a, d)


@pytest.mark.parametrize("stage", ["fit", "scoring"])
def test_split_half_runs_at_the_plans_batches(run_files, monkeypatch, stage):
    """The half fits run at the memory plan's fit batch and the check scores its sample at
    the plan's scoring batch, as the run's own fit and scoring do, not at the settings'
    batch (a plan under --max-gpu-memory may have chosen smaller ones)."""
    from prism_select.curvature import store
    from prism_select.run import preflight, split_half
    real_plan, real_fit, real_many = preflight.make_plan, store.fit_curvature, split_half.score_directions
    fits, scorings = [], []

    def small_batch_plan(model, modules, **kw):
        plan = real_plan(model, modules, **kw)
        getattr(plan, stage)["batch_size"] = 3
        return plan

    monkeypatch.setattr(preflight, "make_plan", small_batch_plan)
    monkeypatch.setattr(store, "fit_curvature", lambda m, mods, enc, cs, **kw: (fits.append((len(enc), cs.batch_size)),
                                                                                 real_fit(m, mods, enc, cs, **kw))[1])
    monkeypatch.setattr(split_half, "score_directions", lambda m, mods, enc, vs, **kw: (
        scorings.append(kw["batch_size"]), real_many(m, mods, enc, vs, **kw))[1])
    _score(run_files, f"sh-{stage}-batch", damping_rule="split-half")
    if stage == "fit":
        assert sorted(fits) == [(12, 3), (12, 3), (24, 3)]
    else:
        assert scorings == [3]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_split_half_on_a_capped_gpu_fits_its_halves_into_host_memory(run_files, monkeypatch):
    """End to end on a GPU under --max-gpu-memory: the half fits come back in host memory,
    the run's own curvature waits in host memory while they are fitted and is back on the
    device when the check ends (then preconditions once and is released: the run's last
    use of it), and run.json records the check's GPU peak."""
    from prism_select.curvature import CurvatureSettings
    from prism_select.model import ModelSettings
    from prism_select.run import curvature_provider, meter, score_pool, split_half
    from prism_select.settings import ScoreSettings
    real_fit, fitted, run_curvature_at = curvature_provider.load_or_fit_curvature, [], []
    real_stage, at_check_end = meter.StageMeter.stage_peak, []

    def fit(*a, **kw):
        if fitted:  # a half: where the run's curvature (the first fit) waits meanwhile
            run_curvature_at.append({t.device.type for t in fitted[0][0].tensors.values()})
        fitted.append(r := real_fit(*a, **kw))
        return r

    def stage_peak(m, stage):
        if stage == "split_half":  # the check is over: where every fit is now
            at_check_end.append([{t.device.type for t in cur.tensors.values()} for cur, _, _ in fitted])
        return real_stage(m, stage)

    for module in (curvature_provider, split_half):  # the run's fit and the check's halves
        monkeypatch.setattr(module, "load_or_fit_curvature", fit)
    monkeypatch.setattr(meter.StageMeter, "stage_peak", stage_peak)
    ms = ModelSettings(model=str(run_files / "model"), dtype="float32", device="cuda",
                       cache_dir=str(run_files / "cache"))
    summary = score_pool(ms, run_files / "pool.jsonl", run_files / "targets.jsonl", run_files / "sh-gpu",
                         ScoreSettings(progress=False, batch_size=4, max_gpu_memory=8 << 30),
                         CurvatureSettings(damping_rule="split-half"))
    # the run's fit back on the device after the check, its two halves in host memory
    assert at_check_end == [[{"cuda"}, {"cpu"}, {"cpu"}]]
    assert run_curvature_at == [{"cpu"}, {"cpu"}]  # in host memory while the halves were fitted
    # the scoring's last use released the run's curvature layer by layer (RunContext.last_use)
    assert [{t.device.type for t in cur.tensors.values()} for cur, _, _ in fitted] == [set(), {"cpu"}, {"cpu"}]
    assert summary["gpu_peak_bytes_by_stage"]["split_half"] > 0


def test_split_half_keeps_its_halves_in_host_memory_under_a_bounded_gpu_plan():
    """The plan counts one curvature on the device (the run's): under a bounded plan on a
    GPU the two half fits wait in host memory; elsewhere they stay where they are fitted."""
    from types import SimpleNamespace
    from prism_select.run.split_half import SplitHalfCheck
    ctx = SimpleNamespace(lm=SimpleNamespace(device=torch.device("cuda", 0)), plan=SimpleNamespace(bounded=True))
    assert SplitHalfCheck._half_fit_layout(ctx).store == "host"
    ctx.plan = SimpleNamespace(bounded=False)
    assert SplitHalfCheck._half_fit_layout(ctx).store == "device"
    ctx.lm, ctx.plan = SimpleNamespace(device=torch.device("cpu")), SimpleNamespace(bounded=True)
    assert SplitHalfCheck._half_fit_layout(ctx).store == "device"
    ctx.plan = None
    assert SplitHalfCheck._half_fit_layout(ctx).store == "device"


def test_ladder_rungs_stacked_as_many_as_fit_beside_a_scoring_batch(monkeypatch):
    """Under a bounded plan the check stacks as many rungs as fit: their directions (held
    three times while the scorer is built) beside what the process holds and one scoring batch's activations
    (the plan's scoring peak less the weights and one v). Counting the directions alone,
    an H200 run under an 11 GiB cap peaked at 9.9 GiB in the check against the plan's 6.8."""
    from types import SimpleNamespace
    from prism_select.curvature import support
    from prism_select.run.split_half import SplitHalfCheck
    mib = 1 << 20
    direction = {"a": torch.zeros(1024, 1024), "b": torch.zeros(1024, 1024)}  # 8 MiB
    per_rung = support.STACKED_LADDER_COPIES * 2 * 8 * mib
    assert support.stacked_ladder_bytes(direction) == per_rung * len(support.DAMPING_LADDER)
    usable, weights, v, activations = 1024 * mib, 100 * mib, 8 * mib, 200 * mib
    ctx = SimpleNamespace(lm=SimpleNamespace(device=torch.device("cuda", 0), model=SimpleNamespace(dtype=torch.float32)),
                          plan=SimpleNamespace(bounded=True, usable=usable, weights=weights,
                                               scoring={"peak": weights + v + activations, "v_bytes": v}),
                          modules={}, settings=SimpleNamespace(max_length=64), scoring_batch=lambda: 8)
    rungs = SplitHalfCheck._ladder_rungs
    for held, k in ((usable - activations - 4 * per_rung, 4), (usable - activations - 2 * per_rung, 2),
                    (usable - activations - 2 * per_rung + 1, 1), (usable - activations - per_rung + 1, 0),
                    # the directions alone fit beside what is held, not with the activations
                    (usable - 4 * per_rung, 0)):
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None, held=held: held)
        assert rungs(ctx, direction) == k, held
    # each stacked direction's backward product (scoring batch tokens x widest input, and its
    # float32 copy) counts too: with a 1024-wide layer, 8 x 64 tokens, 4 MiB a direction
    ctx.modules = {"a": torch.nn.Linear(1024, 16)}
    extra = 2 * 8 * 64 * 1024 * (4 + 4)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: usable - activations - 2 * per_rung)
    assert rungs(ctx, direction) == 1
    monkeypatch.setattr(torch.cuda, "memory_allocated",
                        lambda d=None: usable - activations - 2 * (per_rung + extra))
    assert rungs(ctx, direction) == 2
    ctx.modules = {}
    # unbounded: every rung, as far as STACKED_LADDER_MAX_ELEMENTS allows
    ctx.plan = SimpleNamespace(bounded=False, usable=None)
    assert rungs(ctx, direction) == len(support.DAMPING_LADDER)
    monkeypatch.setattr(support, "STACKED_LADDER_MAX_ELEMENTS", 2 * 2 * (1 << 20) * 2)  # two rungs' numbers
    assert rungs(ctx, direction) == 2
    ctx.lm = SimpleNamespace(device=torch.device("cpu"))
    monkeypatch.setattr(support, "STACKED_LADDER_MAX_ELEMENTS", 0)
    assert rungs(ctx, direction) == 0


def test_split_half_refuses_an_explicit_damping():
    from prism_select.curvature import CurvatureSettings
    from prism_select.errors import ConfigError
    with pytest.raises(ConfigError, match="damping_rule"):
        CurvatureSettings(damping_rule="split-half", damping=1e-3)
    with pytest.raises(ConfigError, match="damping_rule"):
        CurvatureSettings(damping_rule="largest")


def test_a_fitted_curvature_takes_the_split_half_check_only_where_asked():
    """auto decides before the fit (identity in place of a small EK-FAC fit:
    tests/integration/test_small_pool_rule.py); a fit is damped by the heuristic unless
    split-half is asked for."""
    from prism_select.curvature import CurvatureSettings
    from prism_select.run.curvature_provider import damping_rule_of
    for kw in ({}, {"kind": "kfac"}, {"damping_noise": True}, {"damping_rule": "heuristic"}):
        assert damping_rule_of(CurvatureSettings(**kw)) == "heuristic", kw
    assert damping_rule_of(CurvatureSettings(damping_rule="split-half")) == "split-half"


def test_default_run_on_a_small_fit_ranks_with_identity_curvature(run_files):
    s1, a = _score(run_files, "auto", damping_rule="auto")
    s2, b = _score(run_files, "identity", kind="identity")
    assert s1["curvature_applied"]["kind"] == "identity" and s1["curvature"]["kind"] == "identity"
    assert "split_half" not in s1["curvature"] and torch.equal(a, b)
    s3, c = _score(run_files, "plain", damping_rule="heuristic")
    assert s3["curvature_applied"]["kind"] == "ekfac" and not torch.equal(a, c)


# ----------------------------------------------------------------------------- the fit's device memory

def _gpu_like_fit(monkeypatch, tracker):
    """The fit on the CPU taking its GPU code paths where memory differs: factors formed
    whole and summed in place (one GEMM into ``S``, as ``torch.addmm(out=)`` on CUDA), no
    spill file, eigendecompositions one after the other, and the tensors it moves to host
    memory leaving the tracker's device count."""
    from prism_select.curvature import fit as fitmod
    monkeypatch.setattr(factors_mod, "GRAM_BLOCK", 1 << 30)
    monkeypatch.setattr(spill_mod, "SPILL_MAX_BYTES", 0)
    monkeypatch.setattr(factors_mod, "mm_acc_into", lambda M, a, b: M.addmm_(a.to(M.dtype), b.to(M.dtype)))
    monkeypatch.setattr(fitmod, "_to_host", tracker.to_host)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    return threads


def test_fit_device_memory_stays_within_the_plan(tok, encoded_pool, monkeypatch):
    """The live tensor bytes of a grouped, offloaded EK-FAC fit of a bf16 model whose
    factors outweigh its activations (3 blocks, hidden 512) stay within the plan's figure
    for the fit. The eigenvalue pass once allocated every layer's Lambda while the group's
    float32 eigenbases were still on the device (p1 + Lambda, above the plan's
    max(pass 1, pass 2) per layer plus its work space)."""
    from memtrack import LiveBytes
    from tiny import tiny_llama
    from prism_select.plan import ACTIVATION_SAFETY, HEADROOM_BYTES, example_step
    m = tiny_llama(len(tok), dtype=torch.bfloat16, layers=3, hidden=512)
    mods = {n: x for n, x in m.named_modules() if isinstance(x, torch.nn.Linear) and ".layers." in n}
    # two batches: the peak is a batch's (the same 76.4 MB with all 8 examples), each
    # batch of this bf16 model costs seconds on the CPU
    pool = encoded_pool[:4]
    longest = max(pool, key=lambda e: len(e.input_ids))
    with LiveBytes(list(m.parameters())) as probe:
        example_step(m, longest, tok.pad_token_id, "cpu")
    common = dict(kind="ekfac", device="cuda", batch_size=2, fit_batch_size=2,
                  example=ExampleSize(probe.peak, len(longest.input_ids), len(tok)), weights=0, host_available=1 << 40)
    roomy = make_plan(m, mods, gpu_total=1 << 40, **common)
    # a device that holds the group's factors and work space, not the kept curvature as well
    room = roomy.fit["peak"] - roomy.fit["stored_bytes"]
    plan = make_plan(m, mods, gpu_total=HEADROOM_BYTES + room, **common)
    assert plan.curvature_store == "host" and len(plan.fit_groups) == 1, plan.describe()
    tracker = LiveBytes(list(m.parameters()))
    threads = _gpu_like_fit(monkeypatch, tracker)
    try:
        with tracker:
            fit_curvature(m, mods, pool, CurvatureSettings(kind="ekfac", batch_size=plan.fit["batch_size"]),
                          pad_id=tok.pad_token_id,
                          layout=FitLayout(plan.fit_groups, plan.curvature_store))
    finally:
        torch.set_num_threads(threads)
    assert probe.peak > 0 and tracker.peak > 0.5 * plan.fit["peak"]
    assert tracker.peak <= plan.fit["peak"], (tracker.peak, plan.fit["peak"], ACTIVATION_SAFETY)


# ----------------------------------------------------------------------------- host memory

def _qwen14b_on_meta():
    """Qwen3-14B's shapes (as benchmarks/scale_setup.py builds them), bf16, no weights."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40, num_attention_heads=40,
                      num_key_value_heads=8, vocab_size=151936, head_dim=128, tie_word_embeddings=False)
    with torch.device("meta"):
        m = LlamaForCausalLM(cfg).to(torch.bfloat16)
    return m, {n: x for n, x in m.named_modules() if isinstance(x, torch.nn.Linear) and ".layers." in n}


def _host_held(plan, modules) -> int:
    """What the run keeps in host memory at once, by the plan's choices: the float32
    direction, and while a group is fitted its float32 eigenbases (offloaded EK-FAC) or the
    whole kept curvature (``host``)."""
    from prism_select.runtime.layers import layer_shape
    shapes = {n: layer_shape(m) for n, m in modules.items()}
    direction = sum(4 * o * i for o, i in shapes.values()) if plan.direction["store"] == "host" else 0
    if plan.curvature_store == "host":
        return direction + plan.fit["stored_bytes"]
    if plan.curvature_store == "transient" and plan.fit.get("offload", True):
        return direction + max(sum(4 * (o * o + i * i) for o, i in (shapes[n] for n in g)) for g in plan.fit_groups)
    return direction


def test_plan_keeps_host_memory_within_the_host():
    """The 14B measurement: an H200 (139.8 GiB) and 123.5 GiB of host memory available. The
    plan fitted in 2 groups, whose float32 eigenbases (~85 GiB) waited in host memory next
    to the float32 direction (~49 GiB): the process was killed for host memory. The plan
    now counts the host and groups (or keeps on the device) so that it holds."""
    m, mods = _qwen14b_on_meta()
    kw = dict(kind="ekfac", device="cuda", batch_size=8, fit_batch_size=8,
              example=ExampleSize(int(3.56 * GiB), 512, 151936), weights=int(27.6 * GiB),
              host_available=int(123.5 * GiB))
    for gpu in (139.8, 79.6):
        plan = make_plan(m, mods, gpu_total=int(gpu * GiB), **kw)
        assert plan.direction["store"] == "host" and plan.curvature_store == "transient"
        assert _host_held(plan, mods) <= 0.9 * kw["host_available"], (gpu, plan.describe())
        assert plan.host["peak"] <= plan.host["usable"] and plan.fit["peak"] <= plan.usable
        assert plan.to_json()["host"]["available"] == kw["host_available"]
    # a host that cannot hold the float32 direction (49 GiB), nor the device beside V
    with pytest.raises(PlanError, match="host memory"):
        make_plan(m, mods, gpu_total=int(79.6 * GiB), **{**kw, "host_available": 40 * GiB})


def test_deterministic_run_scores_as_the_default_and_is_keyed(run_files, monkeypatch):
    """``deterministic`` reaches the whole run (the kernels are deterministic while the
    model runs) without changing the scores of a float64 CPU run; it is part of the run's
    key, so a resume with the other setting is refused."""
    from prism_select.run import job
    seen = []
    real = job._score_pool

    def spy(*a, **kw):
        seen.append(torch.are_deterministic_algorithms_enabled())
        return real(*a, **kw)

    monkeypatch.setattr(job, "_score_pool", spy)
    summary, got = _score(run_files, "det", deterministic=True)
    _, ref = _score(run_files, "ref")
    assert seen == [True, False] and not torch.are_deterministic_algorithms_enabled()
    assert torch.equal(got, ref)
    from prism_select.settings import ScoreSettings
    assert summary["settings"]["deterministic"] is True
    assert ScoreSettings(deterministic=True).run_key() != ScoreSettings().run_key()


def test_sharded_pass_sums_send_each_input_once(model, modules, tok, encoded_pool, monkeypatch):
    """With the statistics sent once per pass (``--fsdp-sums pass``) the layers reading one
    input (q/k/v, gate/up) send one sum of that input, and its eigenbasis is computed once.
    Over more than two ranks a reduction adds the ranks' copies in an order that depends on
    the offset in its buffer (NCCL's ring): the stand-in all-reduce below adds a rounding
    error of its own at every offset, so copies summed apart would differ in their last
    bits and be decomposed once each (the 4-GPU eigendecompositions of docs/scale.md)."""
    from prism_select.runtime import distributed
    from prism_select.curvature import fit as fitmod

    calls = []

    def offset_order_all_reduce(tensors):
        calls.append(len(tensors))
        off = 0
        for t in tensors:
            t.add_(off * 1e-14 * t.abs().max())  # another order of addition at each offset
            off += t.numel()

    decomposed = []
    from prism_select.curvature import eigh as eighmod
    real_eigh = eighmod._eigh
    monkeypatch.setattr(distributed, "all_reduce_sum", offset_order_all_reduce)
    monkeypatch.setattr(spill_mod, "SPILL_MAX_BYTES", 0)  # the sums of the pass, as on a GPU
    monkeypatch.setattr(eighmod, "_eigh", lambda M: (decomposed.append(M.shape[0]), real_eigh(M))[1])
    s = CurvatureSettings(kind="ekfac", batch_size=3)
    idx = fitmod.fit_indices(len(encoded_pool), s)
    batches = fitmod.length_batches(encoded_pool, idx, s.batch_size)
    timings = {"factors_s": 0.0, "eigh_s": 0.0, "lambda_s": 0.0}
    t = fitmod._fit_group(model, modules, encoded_pool, batches, s, pad_id=tok.pad_token_id,
                          execution=ExecutionContext.of(model, cuda_graphs="off", progress=False), timings=timings,
                          layout=fitmod.FitLayout(sums="pass"), owners={n: 0 for n in modules})
    # a decoder block's distinct inputs: q/k/v's, o's, gate/up's, down's
    n_inputs = 4 * len({n.split(".mlp")[0].split(".self_attn")[0] for n in modules})
    a_sent = calls[0] - 1 - len(modules)  # the factor pass's sums, less n_tokens and one S per layer
    assert a_sent == n_inputs, (a_sent, n_inputs)
    assert len(decomposed) == n_inputs + len(modules)  # one A per input, one S per layer
    for block in {n.rsplit(".", 1)[0] for n in modules if ".self_attn." in n}:  # one eigenbasis per input
        qa = [t[f"{block}.{p}::QA"] for p in ("q_proj", "k_proj", "v_proj")]
        assert torch.equal(qa[0], qa[1]) and torch.equal(qa[0], qa[2])


def test_a_small_default_run_ranks_alike_under_a_grouped_plan(run_files, monkeypatch):
    """The small-pool rule depends on the settings and the fit sample alone: a default run
    under a plan that would group the fit ranks as a whole-curvature one, without a warning."""
    s1, a = _score(run_files, "auto-whole", damping_rule="auto")
    _forced_plan(monkeypatch, "host")
    s2, b = _score(run_files, "auto-grouped", damping_rule="auto")
    assert s1["curvature_applied"] == s2["curvature_applied"] and torch.equal(a, b)
    assert s1["warnings"] == s2["warnings"] == []


def test_ifguide_takes_the_runs_damping_rule(run_files):
    """IF-Guide preconditions through the run's last use of the curvature: on a small fit
    it takes the small-pool rule and an asked-for split-half check as PRISM does."""
    s1, a = _score(run_files, "ifg-auto", damping_rule="auto", method="ifguide")
    s0, b = _score(run_files, "ifg-identity", kind="identity", method="ifguide")
    assert s1["curvature_applied"]["kind"] == "identity" and torch.equal(a, b)
    s2, _ = _score(run_files, "ifg-sh", damping_rule="split-half", method="ifguide")
    assert s2["curvature"]["split_half"]["n_fit"] == 24 and s2["curvature_applied"]["rule"] == "split-half"
