"""``run.json`` as the typed :class:`prism_select.run.Run`: a real run's file read back with
``Run.from_json`` gives every key and value, in the file's order, and written again gives
the same bytes (a tiny float64 model built in-process, in memory and streamed)."""

import json

import pytest
import torch

import prism_select as ps
from prism_select.curvature import CurvatureSettings
from prism_select.examples import make_example
from prism_select.io import atomic_write_json
from prism_select.model import ModelSettings
from prism_select.run import Run, score_pool
from prism_select.settings import ScoreSettings

from tiny import save_tiny


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("run_result")
    pool, targets = make_example(d / "data", n_pool=10, n_pairs=4)
    pairs = targets.read_text().splitlines()
    a, b = d / "data" / "algebra.jsonl", d / "data" / "geometry.jsonl"
    a.write_text("\n".join(pairs[:2]) + "\n")
    b.write_text("\n".join(pairs[2:]) + "\n")
    return {"model": save_tiny(d / "model", dtype=torch.float64), "pool": pool, "targets": targets,
            "tasks": [a, b], "cache": d / "cache"}


def _run(files, targets, out, **kw):
    ms = ModelSettings(model=str(files["model"]), dtype="float64", device="cpu", cache_dir=str(files["cache"]))
    s = ScoreSettings(max_length=128, batch_size=4, chunk_size=4, progress=False, **kw)
    return score_pool(ms, files["pool"], targets, out, s, CurvatureSettings(kind="ekfac", damping_rule="heuristic"))


@pytest.mark.parametrize("case", ["one target set", "two target sets", "stream"])
def test_run_json_round_trips_through_run(files, tmp_path, case):
    targets = files["tasks"] if case == "two target sets" else files["targets"]
    summary = _run(files, targets, tmp_path / "run", **({"stream": True} if case == "stream" else {}))
    path = tmp_path / "run" / "run.json"
    run = Run.from_json(path)
    content = json.loads(path.read_text())
    assert run.to_json() == content and list(run.to_json()) == list(content)  # the keys in the file's order
    atomic_write_json(tmp_path / "again.json", run.to_json())
    assert (tmp_path / "again.json").read_bytes() == path.read_bytes()
    # score_pool returned the file's content
    assert json.loads(json.dumps(summary)) == content
    # the typed fields hold their entries; what the stages recorded is in info
    assert run.status == "complete" and run.method == "prism" and run.counts["pool"] == 10
    assert run.run_key == content["run_key"] and run.memory_plan == content["memory_plan"]
    assert run.curvature_applied["kind"] == "ekfac" and run.info["curvature"]["kind"] == "ekfac"
    assert "pi" in run.info and "throughput" in run.info
    assert run.tasks == (["algebra", "geometry"] if case == "two target sets" else None)
    assert (run.fit_sample is not None) == (case == "stream") and run.stream == (case == "stream")
    assert list(content).index("tasks" if run.tasks else "fingerprints") == list(content).index("inputs") + 1


def test_a_trailing_entry_the_stages_recorded_keeps_its_place():
    """A resumed transient run's stages record ``gpu_peak_bytes`` (the earlier processes'
    peak) among their entries; the run's own figure replaces its value in that place."""
    run = Run(status="complete", command="score", method="prism", settings={}, curvature_settings={}, model={},
              tracked_modules=[], tracking={}, inputs={}, fingerprints={}, versions={}, counts={},
              invalid_records=[], timings={}, warnings=[], stream=False, run_key={"k": 1}, memory_plan={},
              info={"gpu_peak_bytes": 5, "pi": {}}, curvature_applied={"kind": "identity"}, gpu_peak_bytes=7)
    out = run.to_json()
    assert list(out)[-5:] == ["run_key", "memory_plan", "gpu_peak_bytes", "pi", "curvature_applied"]
    assert out["gpu_peak_bytes"] == 7 and "tasks" not in out and "fit_sample" not in out


def test_run_is_on_the_public_face():
    assert ps.Run is Run
