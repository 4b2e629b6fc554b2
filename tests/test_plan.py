"""The memory plan counts only what this process may use of the device: memory that other
processes hold when the plan is made is left out, and a plan error says so."""

from types import SimpleNamespace

import pytest
import torch

from prism_select import pipeline, plan
from prism_select.curvature import CurvatureSettings
from prism_select.settings import ScoreSettings

GIB = 1 << 30


def test_device_memory_leaves_out_what_others_hold(monkeypatch):
    # 80 GiB device, 50 GiB free, this process has reserved 13 GiB: 17 GiB held elsewhere
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (50 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 13 * GIB)
    assert plan.device_memory("cuda:0") == (63 * GIB, 17 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 30 * GIB)  # nothing held elsewhere
    assert plan.device_memory("cuda:0") == (80 * GIB, 0)


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

    monkeypatch.setattr(pipeline, "make_plan", make_plan)
    monkeypatch.setattr(pipeline, "device_memory", lambda d: (63 * GIB, 17 * GIB))
    with pytest.raises(plan.PlanError, match=r"17\.0 GiB of cuda:0 are held outside this run .*other processes"):
        pipeline.plan_run(_fake_cuda_lm(), {}, _no_examples(), ScoreSettings(), CurvatureSettings())
    assert seen["gpu_total"] == 63 * GIB
    # little held elsewhere: the error is the plan's own
    monkeypatch.setattr(pipeline, "device_memory", lambda d: (79 * GIB, GIB // 2))
    with pytest.raises(plan.PlanError) as e:
        pipeline.plan_run(_fake_cuda_lm(), {}, _no_examples(), ScoreSettings(), CurvatureSettings())
    assert str(e.value) == "the target direction does not fit on cuda:0"
