"""The memory plan counts only what this process may use of the device: memory that other
processes hold when the plan is made is left out, and a plan error says so."""

from types import SimpleNamespace

import pytest
import torch

from prism_select import plan
from prism_select.run import preflight
from prism_select.runtime import memory
from prism_select.curvature import CurvatureSettings
from prism_select.settings import ScoreSettings

GIB = 1 << 30


def test_device_memory_leaves_out_what_others_hold(monkeypatch):
    # 80 GiB device, 50 GiB free, this process has reserved 13 GiB: 17 GiB held elsewhere
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (50 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 13 * GIB)
    assert memory.device_memory("cuda:0") == (63 * GIB, 17 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 30 * GIB)  # nothing held elsewhere
    assert memory.device_memory("cuda:0") == (80 * GIB, 0)


def _fake_cuda_lm():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    return SimpleNamespace(model=model, device=torch.device("cuda", 0), tokenizer=[0] * 10)


def _no_examples():
    return SimpleNamespace(encoded=[], fit_encoded=None, chosen=[], rejected=[])


def test_the_plan_gets_the_memory_left_and_its_error_names_what_others_hold(monkeypatch):
    seen = {}

    def make_plan(*args, **kw):
        seen.update(kw)
        raise plan.PlanError("the target direction does not fit on cuda:0")

    monkeypatch.setattr(preflight, "make_plan", make_plan)
    monkeypatch.setattr(preflight, "device_memory", lambda d: (63 * GIB, 17 * GIB))
    with pytest.raises(plan.PlanError, match=r"17\.0 GiB of cuda:0 are held outside this run .*other processes"):
        preflight.plan_run(_fake_cuda_lm(), {}, _no_examples(), ScoreSettings(), CurvatureSettings())
    assert seen["gpu_total"] == 63 * GIB
    # little held elsewhere: the error is the plan's own
    monkeypatch.setattr(preflight, "device_memory", lambda d: (79 * GIB, GIB // 2))
    with pytest.raises(plan.PlanError) as e:
        preflight.plan_run(_fake_cuda_lm(), {}, _no_examples(), ScoreSettings(), CurvatureSettings())
    assert str(e.value) == "the target direction does not fit on cuda:0"


def test_device_headroom_counts_the_cap_what_is_reserved_and_what_is_free(monkeypatch):
    """What the process may still reserve: below the cap set by cap_device_memory (else the
    device's size) less its reservations, and never more than the device has free (other
    processes' memory). CUDA calls stood in for on the CPU."""
    import types

    from prism_select.runtime import memory

    gib = 2**30
    mem = {"reserved": 10 * gib, "free": 100 * gib, "fraction": None}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(total_memory=140 * gib))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: mem.update(fraction=f))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (mem["free"], 140 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: mem["reserved"])
    monkeypatch.setattr(memory, "_CAPS", {})
    dev = torch.device("cuda:0")
    assert memory.device_headroom(dev) == 100 * gib  # no cap: the device's free memory bounds it
    memory.cap_device_memory(dev, 30 * gib)
    assert mem["fraction"] == pytest.approx(30 / 140)
    assert memory.device_headroom(dev) == 20 * gib  # the cap less what is reserved
    mem["free"] = 5 * gib  # other processes took the rest
    assert memory.device_headroom(dev) == 5 * gib
    mem["reserved"] = 31 * gib
    mem["free"] = 100 * gib
    assert memory.device_headroom(dev) == 0
