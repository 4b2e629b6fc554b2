"""FSDP2 sharding (``--shard fsdp``): two CPU processes (gloo, torchrun) on a float64
model give the one-process scores; the row arithmetic matches FSDP's own cut."""

import json
import subprocess
import sys

import pytest
import torch

from prism_select.curvature import stats as stats_mod
from prism_select.runtime import sharding
from prism_select.errors import ConfigError
from prism_select.settings import ScoreSettings

from torchrun import SHARDED_RUNS, moe_args, free_port, run_torchrun, score_args, sharded_dir, torchrun_env

#: float64 model, same examples and arithmetic per layer: only the order of sums differs
SHARDED_REL_TOL = 1e-9


def _scores(d):
    return {json.loads(line)["id"]: json.loads(line)["score"] for line in (d / "scores.jsonl").read_text().splitlines()}


CURVATURES = ("ekfac", "identity")


@pytest.fixture(scope="module")
def runs(two_ranks):
    """``two_ranks`` (the inputs and the sharded runs) with, per curvature, the one-process
    run in ``d / "one-<kind>"``, in this process (a process of its own would only add the
    imports)."""
    d = two_ranks
    from prism_select.cli import main
    for kind in CURVATURES:
        assert main(score_args(d, d / f"one-{kind}", "--curvature", kind)[2:]) == 0
    return d


@pytest.mark.parametrize("curvature,transfers", SHARDED_RUNS)
def test_fsdp_scores_equal_one_process(runs, curvature, transfers):
    out = sharded_dir(runs, curvature, transfers)
    one, two = _scores(runs / f"one-{curvature}"), _scores(out)
    assert list(one) == list(two)
    for k in one:
        assert two[k] == pytest.approx(one[k], rel=SHARDED_REL_TOL, abs=1e-12), k
    # the pairs' batches were dealt to the two ranks (batch size 2 of 3 pairs): every pair's
    # pi and losses come back in pair order
    pairs = lambda d: [json.loads(line) for line in (d / "pairs.jsonl").read_text().splitlines()]  # noqa: E731
    p1, p2 = pairs(runs / f"one-{curvature}"), pairs(out)
    assert [p["id"] for p in p2] == [p["id"] for p in p1] and len(p1) == 3
    for a, b in zip(p1, p2):
        assert b["pi"] == pytest.approx(a["pi"], rel=SHARDED_REL_TOL)
        assert b["loss_chosen"] == pytest.approx(a["loss_chosen"], rel=SHARDED_REL_TOL)
    run = json.loads((out / "run.json").read_text())
    assert run["settings"]["shard"] == "fsdp" and run["distributed"]["world_size"] == 2
    if curvature == "ekfac":  # each rank fitted and kept its own layers' factors
        per = run["curvature"]["factor_shards"]["stored_bytes_per_rank"]
        assert len(per) == 2 and min(per) > 0 and max(per) <= 0.75 * sum(per)
        assert run["curvature"]["path"] is None  # a sharded curvature is not cached
        # the statistics reached their owners as planned
        assert run["memory_plan"]["fit"]["sums"] == ("pass" if transfers == "auto" else "step")
    assert run["memory_plan"]["keep_gathered"] is (transfers == "auto")
    assert not (out / ".partial").exists()


GROUPED = r"""
import os, sys
import prism_select.run.preflight as preflight
from prism_select import cli
from prism_select.runtime import distributed
from prism_select.curvature import fit as fitmod

planned = preflight.make_plan


def three_groups(model, modules, **kw):  # a transient plan in three groups, as a small GPU makes it
    plan = planned(model, modules, **kw)
    names = list(modules)
    k = len(names) // 3
    plan.fit["groups"] = [names[:k], names[k:2 * k], names[2 * k:]]
    plan.curvature_store = "transient"
    return plan


preflight.make_plan = three_groups
fitted = fitmod._fit_group
calls = []


def counted(*a, **kw):
    calls.append(1)
    with open(os.environ["CALLS"] + str(distributed.rank()), "w") as f:
        f.write(str(len(calls)))
    if len(calls) == int(os.environ.get("DIE_AT", "0")):
        distributed.barrier()  # every rank has saved the groups before
        os._exit(3)  # every rank dies while fitting this group
    return fitted(*a, **kw)


fitmod._fit_group = counted
sys.exit(cli.main(sys.argv[1:]))
"""


def test_fsdp_mixture_of_experts_scores_equal_one_process(two_ranks, tmp_path):
    """Every expert's layers sharded with their block (FSDP2 over the per-expert views of
    the fused weights), each rank routing its own batches: the one-process scores."""
    from prism_select.cli import main
    d = two_ranks
    assert main(moe_args(d, tmp_path / "one", "--cache-dir", str(tmp_path / "cache"))) == 0
    one, two = _scores(tmp_path / "one"), _scores(d / "fsdp-moe")
    assert list(one) == list(two)
    for k in one:
        assert two[k] == pytest.approx(one[k], rel=SHARDED_REL_TOL, abs=1e-12), k
    run = json.loads((d / "fsdp-moe" / "run.json").read_text())
    assert run["distributed"]["world_size"] == 2 and run["tracking"]["kinds"]["expert linear"]["modules"] == 8


def test_sharded_transient_run_resumes_finished_groups(runs, tmp_path):
    """--shard fsdp with a transient plan of three groups: every rank saves its rows of each
    group's v; killed in the third group, the same command fits only that group again and
    gives the one-process scores."""
    script = tmp_path / "grouped.py"
    script.write_text(GROUPED)
    args = [str(script), *score_args(runs, tmp_path / "fsdp", "--curvature", "ekfac", "--shard", "fsdp",
                                "--cache-dir", str(tmp_path / "cache-fsdp"))[2:]]
    env = dict(torchrun_env(), CALLS=str(tmp_path / "calls"), DIE_AT="3")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--nnodes=1",
           f"--master-port={free_port()}", "--master-addr=127.0.0.1", *args]
    died = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert died.returncode != 0
    partial = tmp_path / "fsdp" / ".partial"
    assert sorted(p.name for p in partial.glob("scores_v_group0001*")) == [
        "scores_v_group0001.json", "scores_v_group0001.rank00000-of-00002.safetensors",
        "scores_v_group0001.rank00001-of-00002.safetensors"]
    assert not list(partial.glob("scores_v_group0002*"))
    env["DIE_AT"] = "0"
    cmd[5] = f"--master-port={free_port()}"
    again = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (tmp_path / "calls0").read_text() == "1"  # only the unfinished group was fitted again
    one, two = _scores(runs / "one-ekfac"), _scores(tmp_path / "fsdp")
    for k in one:
        assert two[k] == pytest.approx(one[k], rel=SHARDED_REL_TOL, abs=1e-12), k
    run = json.loads((tmp_path / "fsdp" / "run.json").read_text())
    assert run["curvature"]["resumed_groups"] == 2


WORKER = r"""
import json, os, sys
import torch
from prism_select.runtime import distributed, sharding
distributed.init_from_env("cpu")
torch.manual_seed(0)
# a tiny Llama's linear shapes (hidden 20, 2 heads, 1 key-value head), in torch modules
# alone: transformers would only add its imports, in each of the three processes
SHAPES = {{"self_attn.q_proj": (20, 20), "self_attn.k_proj": (20, 10), "self_attn.v_proj": (20, 10),
          "self_attn.o_proj": (20, 20), "mlp.gate_proj": (20, 40), "mlp.up_proj": (20, 40),
          "mlp.down_proj": (40, 20)}}


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn, self.mlp = torch.nn.Module(), torch.nn.Module()
        for name, (i, o) in SHAPES.items():
            part, proj = name.split(".")
            setattr(getattr(self, part), proj, torch.nn.Linear(i, o, bias=False))


model = torch.nn.Module()
model.embed_tokens, model.lm_head = torch.nn.Embedding(50, 20), torch.nn.Linear(20, 50, bias=False)
model.layers = torch.nn.ModuleList([Block(), Block()])
modules = {{n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "layers." in n}}
assert len(modules) == 2 * len(SHAPES)
full = {{n: m.weight.detach().clone() for n, m in modules.items()}}
sharding.shard_model(model, modules, "cpu")
out = {{}}
for n, m in modules.items():
    a, b = sharding.row_range(m.out_features, distributed.rank(), distributed.world())
    mine = sharding.local(m.weight)
    out[n] = bool(torch.equal(mine, full[n][a:b])) and tuple(sharding.local(m.prism_v).shape) == tuple(mine.shape)
    rows = torch.arange(m.out_features, dtype=torch.float64)[a:b, None].expand(-1, m.in_features)
    out[n] = out[n] and bool(torch.equal(sharding.gather_rows(rows.contiguous(), m.out_features)[:, 0],
                                         torch.arange(m.out_features, dtype=torch.float64)))
with open(sys.argv[1] + str(distributed.rank()), "w") as f:
    json.dump(out, f)
distributed.barrier()  # no rank tears the group down while another is still in a collective
distributed.destroy()
# FSDP's device mesh still holds the gloo group: freed in the interpreter's own teardown, its
# threads can abort a finished rank ("terminate called without an active exception")
os._exit(0)
"""


def test_row_range_is_fsdp_cut(tmp_path):
    """Rows over 3 ranks, uneven cuts included (hidden 20: 7/7/6; k/v with 10 outputs: 4/4/2)."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format())
    run_torchrun(3, [str(script), str(tmp_path / "rank")], tmp_path)
    for r in range(3):
        got = json.loads((tmp_path / f"rank{r}").read_text())
        assert got and all(got.values()), (r, got)


def test_row_range_covers_rows_once():
    for rows in (1, 5, 10, 4096, 14336):
        for world in (1, 2, 3, 4, 8):
            cut = [sharding.row_range(rows, r, world) for r in range(world)]
            assert cut[0][0] == 0 and cut[-1][1] == rows
            assert all(cut[i][1] == cut[i + 1][0] for i in range(world - 1))


def test_shard_settings_refused_with_the_fix():
    with pytest.raises(ConfigError, match="does not run under --shard fsdp"):
        ScoreSettings(shard="fsdp", method="random")
    with pytest.raises(ConfigError, match="unknown value"):
        ScoreSettings(shard="ddp")
    with pytest.raises(ConfigError, match="fsdp_sums.*use one of auto, step, pass"):
        ScoreSettings(fsdp_sums="never")
    with pytest.raises(ConfigError, match="fsdp_keep_gathered.*use one of auto, on, off"):
        ScoreSettings(fsdp_keep_gathered="yes")
    with pytest.raises(ConfigError, match="several processes"):
        sharding.shard_model(torch.nn.Linear(2, 2), {}, "cpu")


def test_sums_in_flight_are_bounded_and_each_reaches_its_accumulators(monkeypatch):
    """The sharded fit's sums (:class:`stats._Sum`): at most REDUCE_WINDOW wait unfinished,
    the oldest finish first, each sum is added to every accumulator registered for it
    (before or after it finished), and a step's end finishes the rest."""
    from prism_select.runtime import distributed
    from prism_select.curvature import fit

    started, finished = [], []

    def fake_async(t, dst):
        i = len(started)
        started.append(i)

        def finish():
            finished.append(i)
            return t * 10  # "the sum over the ranks"
        return finish

    monkeypatch.setattr(distributed, "reduce_sum_to_async", fake_async)
    st = stats_mod._Stats(torch.float64)
    A, B = torch.zeros(2), torch.zeros(2)
    sums = []
    for i in range(5):
        s = st.summed(torch.full((2,), float(i + 1)), owner=0)
        s.then(A.add_)
        sums.append(s)
        assert len(started) - len(finished) <= stats_mod.REDUCE_WINDOW
    assert finished == [0, 1, 2]
    sums[0].then(B.add_)  # a layer reading the same input after its sum finished
    sums[4].then(B.add_)  # ... and before
    st.drain()
    assert finished == [0, 1, 2, 3, 4]
    assert A.tolist() == [150.0, 150.0]  # (1 + 2 + 3 + 4 + 5) x 10
    assert B.tolist() == [60.0, 60.0]  # (1 + 5) x 10
